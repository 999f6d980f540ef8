"""Chat templates: the model directory's own, rendered with jinja2's sandbox (as HF transformers does).

    t = ChatTemplate.from_dir(model_dir)       # None when the model has none
    messages = chat_messages(body["messages"])  # OpenAI's messages checked (ApiError(400) naming the field)
    text = t.render(messages, add_generation_prompt=True, kwargs=chat_template_kwargs)

Where the template comes from, first found wins: `chat_template.jinja`, then tokenizer_config.json's
`chat_template` (a string, or a list of {"name", "template"}: the one named "default"). The template
sees messages, add_generation_prompt, tools (None), bos_token / eos_token (tokenizer_config.json's),
raise_exception(msg), strftime_now(fmt), plus every chat_template_kwargs key (e.g. Qwen3.5's
enable_thinking). A template whose source never names the developer role sees developer messages as system
messages (OpenAI's developer role is the system role of the models before it). The environment is jinja2's ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and loop controls ({% break %}), and a `tojson` that keeps non-ASCII text.
Rendering errors (the template's raise_exception, a sandbox refusal, a type error) are ChatTemplateError.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from router.http.errors import bad
from router.http.tools import message_tool_calls

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The template refused the messages or failed to render them."""


def _token_text(v) -> str:
    if isinstance(v, dict):  # {"content": "<|endoftext|>", "lstrip": false, ...}
        v = v.get("content", "")
    return v if isinstance(v, str) else ""


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(str(message))

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=jinja2.Undefined
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template{origin and ' in ' + origin} does not compile: {e}") from e
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> "ChatTemplate | None":
        if model_dir is None:
            return None
        d = Path(model_dir)
        cfg: dict = {}
        if (d / CONFIG_FILE).is_file():
            try:
                cfg = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                cfg = {}
            cfg = cfg if isinstance(cfg, dict) else {}
        tokens = dict(bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")))
        if (d / TEMPLATE_FILE).is_file():
            return cls((d / TEMPLATE_FILE).read_text(encoding="utf-8"), origin=str(d / TEMPLATE_FILE), **tokens)
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
            )
        if isinstance(source, str) and source.strip():
            return cls(source, origin=str(d / CONFIG_FILE), **tokens)
        return None

    def render(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None, kwargs: dict | None = None
    ) -> str:
        """kwargs: chat_template_kwargs (they cannot replace messages, add_generation_prompt or tools)."""
        import jinja2

        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **(kwargs or {})}
        if "developer" not in self.source:  # a template without the role (Qwen3.5's refuses it): a system message
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        context.update(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)
        try:
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError, RecursionError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


def chat_messages(v) -> list[dict]:
    """A chat body's `messages` -> the template's messages: roles checked, text parts joined, content null
    -> "", name / reasoning_content / tool_call_id kept, assistant tool_calls' arguments as objects."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise bad(where + ".role", f"{role!r:.40} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(
                        f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported"
                    )
                parts.append(p["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise bad(
                where + ".content", f"expected a string, a list of text parts, or null, got {type(content).__name__}"
            )
        msg = {k: x for k, x in m.items() if k in ("name", "reasoning_content", "tool_call_id") and isinstance(x, str)}
        msg.update(role=role, content=content if content is not None else "")
        if m.get("tool_calls"):
            msg["tool_calls"] = message_tool_calls(m["tool_calls"], where + ".tool_calls")
        out.append(msg)
    return out
