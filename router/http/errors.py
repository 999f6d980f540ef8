"""HTTP errors in OpenAI's JSON shape, and the gRPC status -> HTTP status mapping.

    raise ApiError(400, "max_tokens: must be >= 1", param="max_tokens")
    ApiError.from_status(StatusError)     # a router status (Generate's own) as the HTTP error
    err.body() -> {"error": {"message", "type", "param", "code"}}

Mapping (the router's gRPC codes): INVALID_ARGUMENT 400, UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything else 500. A router message starts with the gRPC field
it blames ("max_new_tokens: ..."); `rename` maps those names to the HTTP request's ("max_tokens: ...").
"""

from __future__ import annotations

import re

import grpc

C = grpc.StatusCode
HTTP_STATUS = {
    C.INVALID_ARGUMENT: 400,
    C.UNAUTHENTICATED: 401,
    C.RESOURCE_EXHAUSTED: 429,
    C.UNAVAILABLE: 503,
    C.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        m = _FIELD.match(message)
        self.param = param if param is not None else (m.group(1) if m and status == 400 else None)
        self.code = code
        self.from_router = False  # Generate's own status: the router's request line logged it already

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, rename: dict[str, str] | None = None) -> "ApiError":
        for old, new in (rename or {}).items():
            message = re.sub(rf"\b{re.escape(old)}\b", new, message)
        e = cls(HTTP_STATUS.get(code, 500), message, code=code.name.lower())
        e.from_router = True
        return e

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPE.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad(field: str, why: str) -> ApiError:
    """400 naming the field first, as the router's INVALID_ARGUMENT messages do."""
    return ApiError(400, f"{field}: {why}", param=field, code="invalid_argument")
