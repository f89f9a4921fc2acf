"""The models the router serves (ListModels, cached briefly), and for each the tokenizer and the
sampling defaults of its folder."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.errors import ModelNotFound
from tandem.engine.models.config import load_sampling_defaults
from tandem.engine.models.source import resolve_model
from tandem.engine.sampling_params import SamplingDefaults
from tandem.services.gateway.errors import APIError
from tandem.services.gateway.router_client import RouterClient
from tandem.services.gateway.tokenizer import GatewayTokenizer

log = logging.getLogger(__name__)

# After a miss (unknown model, or none served), ask the router again at most this often.
_MISS_REFRESH_S = 0.5


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_context_len: int
    vocab_size: int
    tokenizer: GatewayTokenizer
    sampling: SamplingDefaults = SamplingDefaults()   # what a request's unset sampling fields become
    parent: str = ""                                  # a LoRA adapter: its base model (whose files it uses)


class ModelCatalog:
    def __init__(self, router: RouterClient, ttl_s: float = 5.0, tokenizer_path: str | None = None):
        self.router = router
        self.ttl_s = ttl_s
        self.tokenizer_path = tokenizer_path
        self.created = int(time.time())
        self._models: dict[str, ServedModel] = {}
        self._files: dict[str, tuple[GatewayTokenizer, SamplingDefaults]] = {}
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()

    async def models(self) -> list[ServedModel]:
        if time.monotonic() - self._fetched_at > self.ttl_s:
            await self._refresh(self._fetched_at)
        return list(self._models.values())

    def invalidate(self) -> None:
        """What the router serves changed (a runtime LoRA load): ask it again on the next lookup."""
        self._fetched_at = float("-inf")

    async def get(self, name: str | None) -> ServedModel:
        """The model a request names (or the only one served when it names none).

        Raises APIError 503 when no worker is registered, 404 for a model nobody serves.
        """
        age = time.monotonic() - self._fetched_at
        missing = name not in self._models if name else not self._models
        if age > self.ttl_s or (missing and age > _MISS_REFRESH_S):
            await self._refresh(self._fetched_at)
        if not self._models:
            raise APIError(503, "no workers are registered with the router; retry when the workers are up",
                           code="no_workers")
        if not name:
            if len(self._models) > 1:
                raise APIError(400, f"`model` is required; served: {', '.join(sorted(self._models))}", "model")
            return next(iter(self._models.values()))
        model = self._models.get(name)
        if model is None:
            raise APIError(404, f"the model `{name}` does not exist; served: {', '.join(sorted(self._models))}",
                           "model", code="model_not_found")
        return model

    async def _refresh(self, seen: float) -> None:
        async with self._lock:
            if self._fetched_at != seen:  # someone refreshed while we waited for the lock
                return
            infos = await self.router.list_models()
            models = {}
            for info in infos:
                folder = info.parent or info.id        # an adapter speaks its base model's tokenizer
                files = self._files.get(folder)
                if files is None:
                    files = self._files[folder] = await asyncio.to_thread(self._load_files, folder)
                models[info.id] = ServedModel(info.id, info.max_context_len, info.vocab_size, *files,
                                              parent=info.parent)
            self._models = models
            self._fetched_at = time.monotonic()

    def _load_files(self, model_id: str) -> tuple[GatewayTokenizer, SamplingDefaults]:
        """The tokenizer, and the sampling defaults (OpenAI's, under what the folder's
        generation_config.json recommends: the workers' engines read the same file)."""
        try:
            folder = Path(self.tokenizer_path) if self.tokenizer_path else resolve_model(model_id)
            tok = GatewayTokenizer.from_folder(folder)
        except (ModelNotFound, OSError, ValueError) as e:
            raise APIError(500, f"the gateway cannot load the tokenizer of `{model_id}` ({e}); "
                                "start it with --tokenizer PATH") from e
        log.info("tokenizer for %s loaded from %s", model_id, folder)
        return tok, load_sampling_defaults(folder)
