"""The refusal an admin operation raises; the admin HTTP stack turns it into the shared error shape.

Its own module so that service layers can raise it without importing the HTTP stack."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal the client gets as `{"error": {code, message, details, request_id}}`; raising it inside a
    unit of work rolls the change back."""

    def __init__(self, status: int, code: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details or {}
