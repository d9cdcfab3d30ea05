"""An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, with its HTTP status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import ErrorBody, ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"  # OpenAI's types
        body = ErrorBody(message=str(self), type=kind, param=self.param, code=self.code)
        return JSONResponse(ErrorResponse(error=body).model_dump(), status_code=self.status)
