"""The HTTP API's n choices (router/http/schemas.py): each prompt's n Generate requests announce their n
equal prompts (GenerateRequest.equal_prompts), so the prefill worker computes each prompt once; one choice
announces nothing."""

from __future__ import annotations

from router.http.schemas import Limits, parse_completion

LIM = Limits(model_id="m", max_context=512, width=8, tokenizer=None)


def test_each_prompt_s_choices_announce_n_equal_prompts():
    job = parse_completion({"model": "m", "prompt": [[1, 2, 3], [4, 5]], "n": 3, "max_tokens": 4, "seed": 9}, LIM)
    got = [(list(r.token_ids.ids), r.equal_prompts, r.sampling.seed) for r in job.requests]
    assert got == [
        ([1, 2, 3], 3, 9),
        ([1, 2, 3], 3, 10),
        ([1, 2, 3], 3, 11),
        ([4, 5], 3, 9),
        ([4, 5], 3, 10),
        ([4, 5], 3, 11),
    ]
    (one,) = parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}, LIM).requests
    assert one.equal_prompts == 0
