"""The trainer side: publish local shards through refitd and drive vLLM's handshake.

:class:`RefitdTrainerEngine` is vLLM's ``TrainerWeightTransferEngine`` for the
``refitd`` backend. Every trainer rank publishes its own shards (a
:mod:`refitd.integrations.sources` source: FSDP2, Megatron-style blocks or plain
tensors; no gather) as one publisher part of the version; the sender (rank 0)
waits until every part is in (the version is READY), then drives the engine
through any ``VLLMWeightSyncClient``: ``start_weight_update``,
``update_weights({"version": N})``, ``finish_weight_update``. All ranks then meet
at a barrier (when ``torch.distributed`` is initialized), so no rank rewrites its
memory for the next version while the engine still reads this one. With
``adopt=True`` (training writes the published memory itself) each rank then retires
the version, so no later reader can lease bytes that training is changing.

:class:`LLMSyncClient` adapts an in-process ``vllm.LLM`` to the client protocol;
vLLM's own ``HTTPVLLMWeightSyncClient`` (for ``vllm serve``) and Ray client work
as they are.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from refitd.errors import NotFoundError, TransportError
from refitd.integrations.sources import NameMap, ShardPublisher, as_shard_source
from refitd.wire import VersionState

__all__ = ["LLMSyncClient", "RefitdTrainerEngine", "RefitdTrainerInitInfo"]


@dataclass
class RefitdTrainerInitInfo(TrainerInitInfo):
    """``rank`` (keyword) of ``world_size`` publishing ranks; ``url`` this rank's
    daemon (empty: ``$REFITD_URL``, else the configured listener); ``engine_source_url``
    the URL the engine's workers reach the trainer's daemon at, when it is not their
    own node's daemon. ``worker`` holds extra worker init keys (``mode``,
    ``allow_unwritten``, ``lease_ttl_s``, ``url``)."""

    backend: ClassVar[str] = "refitd"

    model: str = "policy"
    world_size: int = 1
    url: str = ""
    token_file: str = ""
    engine_source_url: str = ""
    adopt: bool = False
    #: 2: publish rounds into two alternating buffers, for delta refit (docs/delta.md)
    buffers: int = 1
    ready_timeout_s: float = 120.0
    worker: dict[str, Any] = field(default_factory=dict)
    name_map: NameMap = None


class RefitdTrainerEngine(TrainerWeightTransferEngine[RefitdTrainerInitInfo]):
    """Publishes this rank's shards each round and (rank 0) refits the engine."""

    init_info_cls = RefitdTrainerInitInfo

    def __init__(
        self, info: RefitdTrainerInitInfo, *, client: Any, source: Any, is_sender: bool
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        from refitd.integrations.connect import daemon_client

        self.info = info
        self._runner = asyncio.Runner()
        self.daemon = daemon_client(info.url, info.token_file)
        self.shards = ShardPublisher(
            self.daemon,
            info.model,
            info.rank,
            info.world_size,
            adopt=info.adopt,
            buffers=info.buffers,
        )
        self.version = self._run(self._latest())
        self.last: dict[str, float] = {}

    @classmethod
    def trainer_init(
        cls, init_info: RefitdTrainerInitInfo, *, client: Any, source: Any = None
    ) -> Self:
        if source is None:
            raise ValueError("the refitd trainer engine publishes a source: pass source=")
        engine = cls(init_info, client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            worker = {"model": init_info.model, **init_info.worker}
            if init_info.engine_source_url:
                worker["source_url"] = init_info.engine_source_url
            client.init_weight_transfer_engine(worker)
        return engine

    def _run(self, coro: Any) -> Any:
        return self._runner.run(coro)

    async def _latest(self) -> int:
        """The highest version number the model has had, READY or retired (versions
        only move forward). A pending one is not counted: it may be another rank's
        part of the very version this rank is about to publish."""
        try:
            versions = await self.daemon.versions(self.info.model)
        except NotFoundError:
            return 0
        done = [int(v.version) for v in versions if v.state is not VersionState.PENDING]
        return max(done, default=0)

    async def _wait_ready(self, version: int) -> None:
        """Return once ``version`` is READY: long polls of the daemon, which answers
        the moment the last rank's part lands."""
        deadline = time.monotonic() + self.info.ready_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                info = await self.daemon.wait_ready(self.info.model, version, left)
            except NotFoundError:
                info = None  # no part of it yet: asked again until the deadline
                await asyncio.sleep(min(left, 0.5))  # a timer: nothing to wait on yet
            if info is not None and info.state is VersionState.READY:
                return
            if info is not None and info.state is VersionState.RETIRED:
                raise TransportError(f"{self.info.model!r} v{version} was retired before READY")
        raise TransportError(
            f"{self.info.model!r} v{version} not READY after "
            f"{self.info.ready_timeout_s:.0f}s: a trainer rank did not publish its part"
        )

    def publish(self, version: int | None = None) -> int:
        """Publish this rank's shards as ``version`` (default: the next one)."""
        version = self.version + 1 if version is None else version
        source = as_shard_source(self.source, self.info.name_map)
        self._run(self.shards.publish(source, version))
        self.version = version
        return version

    def publish_ready(self, version: int | None = None) -> int:
        """Publish this rank's shards as ``version`` (default: the next one) and return
        it once every rank's part is in (READY): what an in-flight refit
        (:mod:`refitd.integrations.vllm.inflight`) then prefetches."""
        version = self.publish(version)
        self._run(self._wait_ready(version))
        return version

    def send_weights(self, version: int | None = None) -> None:
        t0 = time.perf_counter()
        version = self.publish(version)
        t1 = time.perf_counter()
        if self.is_sender:
            self._run(self._wait_ready(version))
            t2 = time.perf_counter()
            self.client.start_weight_update()
            self.client.update_weights({"version": version})
            self.client.finish_weight_update(weight_version=str(version))
            self.last = {
                "publish_s": t1 - t0,
                "ready_s": t2 - t1,
                "engine_s": time.perf_counter() - t2,
            }
        self._barrier()
        if self.info.adopt:
            # Training writes the published memory next: no reader may lease it again.
            self._run(self.shards.retire())

    @staticmethod
    def _barrier() -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def shutdown(self) -> None:
        self._run(self.shards.close())
        self._run(self.daemon.close())
        self._runner.close()


class LLMSyncClient:
    """``VLLMWeightSyncClient`` over an in-process ``vllm.LLM`` (offline RL loops)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
