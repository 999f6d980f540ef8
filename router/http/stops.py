"""Stop strings, matched on the streamed text here in the HTTP layer (the router stops on token ids only).

    m = StopMatcher(("\\n\\n", "```"))
    out, hit = m.push(delta)    # text safe to send now; hit = a stop string was completed
    out = m.flush()             # at the end of the stream (no stop string): what was held back

Only text that cannot begin a stop string is released: a suffix of what was received that is a prefix
of some stop string is held back until the next delta decides it. The text sent is the generated text
cut just before the stop string that completed first (the earliest end in the text; on a tie the one
starting first), whatever the chunking; the stop string itself is not sent, as in OpenAI's API. The caller then ends the Generate call (cancelled: its sessions are released) and reports
finish_reason "stop"; usage counts the tokens generated up to the one that completed the stop string.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self._held + delta
        hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if hits:  # the stop string completed first (the earliest end; on a tie, the longest)
            self._held = ""
            return text[: min(hits)[1]], True
        keep = 0
        for s in self.stops:  # longest suffix of text that is a proper prefix of s
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
