"""Plain-data view of a plan, shared by the Django layer and the Redis ledger (no Django imports)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

LIMIT_FIELDS = (
    "tokens_per_day",
    "tokens_per_month",
    "requests_per_minute",
    "concurrent_requests",
    "max_tokens_per_request",
)


@dataclass(frozen=True)
class PlanLimits:
    """None means unlimited; an empty allowed_models means every model."""

    name: str = "default"
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    requests_per_minute: int | None = None
    concurrent_requests: int | None = None
    max_tokens_per_request: int | None = None
    allowed_models: tuple[str, ...] = field(default_factory=tuple)
    share: float = 1.0  # the fair share weight its users' engine requests carry

    @classmethod
    def from_mapping(cls, data: dict) -> "PlanLimits":
        values = {k: data.get(k) for k in LIMIT_FIELDS}
        return cls(
            name=data.get("name", "default"),
            allowed_models=tuple(data.get("allowed_models") or ()),
            share=float(data.get("share", 1.0)),
            **values,
        )

    def allows_model(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models

    def as_dict(self) -> dict:
        data = asdict(self)
        data["allowed_models"] = list(self.allowed_models)
        return data
