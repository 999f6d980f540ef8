"""Logging set-up of every Baton process (workers, router, `baton serve`): one line per record on stderr.

    setup_logging(settings)     BATON_LOG_LEVEL (settings.log_level) and BATON_LOG_JSON (settings.log_json)

Plain lines are `TIME LEVEL LOGGER: MESSAGE`; with BATON_LOG_JSON each line is one JSON object
{"t", "level", "logger", "msg"} (+ "exc" with a traceback), built with json.dumps, so a message holding
quotes or newlines (the router's `request {...}` line) still parses."""

from __future__ import annotations

import json
import logging
import sys

PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "t": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(settings) -> None:
    """The root logger at settings.log_level, to stderr, plain or JSON (settings.log_json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_json else logging.Formatter(PLAIN))
    logging.basicConfig(level=settings.log_level, handlers=[handler])
