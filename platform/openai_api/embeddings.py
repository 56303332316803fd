"""A /v1/embeddings body -> an EmbeddingCall (the engine's Generation: one embedding request per input),
and the finished Result -> OpenAI's embedding list.

The view and the batch runner both build here, so a batch line and the same request sent to
/v1/embeddings give the same engine requests and the same body. No `request` objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from errors import InvalidRequest, ServiceError
from generation import catalog, tokenization
from generation.result import Result
from generation.services import Generation
from inference import protocol

from . import calls
from .embeddings_serializers import EmbeddingRequestSerializer

ENDPOINT = "/v1/embeddings"
ID_PREFIX = "embd-"


@dataclass
class EmbeddingCall:
    """One /v1/embeddings request: what runs (gen) and how its vectors are written."""

    gen: Generation
    encoding_format: str = "float"
    headers: dict = field(default_factory=dict)  # x-ratelimit-*
    n = 1  # one result per input (calls.admit reads it)

    @property
    def request_id(self) -> str:
        return self.gen.request_id

    @property
    def model(self) -> str:
        return self.gen.model


def build_call(*, body: dict, user, source: str = "api", api_key=None, models: dict | None = None) -> EmbeddingCall:
    """Validate the body and build the engine requests (errors.ServiceError for anything refused).

    models: the served models to look the model up in (a batch); None asks the live workers, where
    an unknown model is a 404."""
    data = calls.validate(EmbeddingRequestSerializer, body)
    model = data["model"]
    info = catalog.resolve_model(model) if models is None else models.get(model, {})
    check_embedding_model(model, info)
    pooling_params = {"dimensions": data["dimensions"]} if data.get("dimensions") is not None else {}
    check_dimensions(data.get("dimensions"), info.get("pooling") or {})
    prompts = input_ids(data["input"], info["model_path"], info.get("max_model_len"))
    gen = Generation(
        source=source,
        endpoint=ENDPOINT,
        user=user,
        api_key=api_key,
        model=model,
        prompts=prompts,
        sampling_params={},
        pooling_params=pooling_params,
        max_tokens=0,
        end_user=data.get("user") or "",
        request_id=ID_PREFIX + protocol.new_request_id(),
    )
    return EmbeddingCall(gen=gen, encoding_format=data["encoding_format"])


def check_embedding_model(model: str, info: dict) -> None:
    if info.get("task") != protocol.EMBED_TASK:
        raise InvalidRequest(
            f"The model '{model}' does not support embeddings: it generates text. "
            "Use /v1/chat/completions or /v1/completions, or an embedding model.",
            param="model",
            code="model_not_supported",
        )


def check_dimensions(dimensions: int | None, pooling: dict) -> None:
    """`dimensions` only for models trained for truncated embeddings (Matryoshka), within their sizes."""
    size, allowed = pooling.get("dimension"), pooling.get("matryoshka_dimensions")
    if dimensions is None or dimensions == size:
        return
    if allowed is None:
        raise InvalidRequest(
            f"This model does not support 'dimensions': its embeddings have {size} dimensions "
            "and it was not trained for shorter ones.",
            param="dimensions",
            code="unsupported_parameter",
        )
    if (size and dimensions > size) or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {size}"
        raise InvalidRequest(
            f"Invalid value for 'dimensions': this model gives {sizes}; got {dimensions}.", param="dimensions"
        )


def input_ids(inputs: list, path: str, max_model_len: int | None) -> list[list[int]]:
    """Each input's token ids (text tokenized with the model's special tokens, as sentence-transformers
    does); 400 naming the input that is outside the vocabulary or longer than the model takes."""
    vocab = len(tokenization.tokenizer_for(path))
    prompts = []
    for i, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(item, str):
            check_chars(item, path, max_model_len, param)
            ids = tokenization.text_prompt_ids(path, item)
        else:
            ids = list(item)
            if max(ids) >= vocab:
                raise InvalidRequest(f"The input has token ids outside the vocabulary [0, {vocab}).", param=param)
        if max_model_len is not None and len(ids) > max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens, however you "
                f"requested {len(ids)} tokens in the input. Please reduce the length.",
                param=param,
                code="context_length_exceeded",
            )
        prompts.append(ids)
    return prompts


def check_chars(text: str, path: str, max_model_len: int | None, param: str) -> None:
    """A text that cannot fit is refused before it is tokenized (a megabyte takes the tokenizer a second)."""
    if max_model_len is None:
        return
    at_least = -(-len(text) // tokenization.longest_token_chars(path))
    if at_least > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, the input "
            f"has {len(text)} characters, at least {at_least} tokens. Please reduce the length.",
            param=param,
            code="context_length_exceeded",
        )


def response_body(call: EmbeddingCall, result: Result) -> dict:
    """OpenAI's embedding list: one entry per input, in input order, and the prompt tokens used."""
    missing = [i for i in range(len(call.gen.prompts)) if i not in result.embeddings]
    if missing:
        raise ServiceError(
            f"The engine finished without the embedding of input {missing[0]}.", status=500, code="engine_error"
        )
    data = [
        {"object": "embedding", "index": i, "embedding": vector(result.embeddings[i], call.encoding_format)}
        for i in range(len(call.gen.prompts))
    ]
    prompt_tokens = result.prompt_tokens if result.prompt_tokens is not None else call.gen.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": call.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def vector(event: dict, encoding_format: str):
    """The engine sends float32 little-endian bytes in base64, which is OpenAI's base64 format as it is."""
    return event["embedding"] if encoding_format == "base64" else protocol.embedding_floats(event)
