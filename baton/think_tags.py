"""A reasoning model's thinking block in a prompt's text (Qwen3 / Qwen3.5's tags), shared by the router's HTTP
reasoning parser (router/http/reasoning.py) and the thinking budget's resolution (baton/sampling_rules.py
think_budget, used by the router and `baton complete`).

    think_open(prompt) -> bool   # the prompt's last assistant turn leaves a <think> block open
"""

from __future__ import annotations

THINK, THINK_END = "<think>", "</think>"
ASSISTANT = "<|im_start|>assistant"  # the start of an assistant turn in Qwen's ChatML templates


def think_open(prompt: str) -> bool:
    """The rendered prompt leaves a <think> block open: the text of its last assistant turn (from the last
    ASSISTANT on; the whole prompt when it has none) holds a "<think>" that no "</think>" follows. The one
    test of it: a forced tool call closes that block (router/http/tools.py), the parser starts in it, and a
    thinking budget applies only then."""
    turn = prompt[max(0, prompt.rfind(ASSISTANT)) :]
    return turn.rfind(THINK) > turn.rfind(THINK_END)
