"""Stored responses, per user: the selector and the services behind retrieval, delete and previous_response_id."""

from __future__ import annotations

from common.storable import storable

from .models import StoredResponse


def stored_response(*, user, response_id: str) -> StoredResponse | None:
    """The user's stored response with this id; None for an unknown id and for another user's."""
    return StoredResponse.objects.filter(user=user, public_id=response_id).first()


def store_response(*, user, body: dict, conversation: list[dict]) -> StoredResponse:
    return StoredResponse.objects.create(
        public_id=body["id"], user=user, model=body["model"], body=storable(body), conversation=storable(conversation)
    )


def delete_response(*, user, response_id: str) -> bool:
    """True when the user had it (and now does not)."""
    deleted, _ = StoredResponse.objects.filter(user=user, public_id=response_id).delete()
    return deleted > 0
