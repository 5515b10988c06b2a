"""Rank 0 of a tensor-parallel model: the torch backend whose forward runs on every rank.

Each step: one broadcast of a fixed header and one of the batch's model inputs packed into an
int64 buffer (``step_broadcast``); then every rank runs the same forward on its shard (per
layer one all-reduce after o and one after down, one for the vocab-parallel embedding, one
gather of the logit shards to rank 0), and rank 0 samples as the plain torch backend does.
The engine and the scheduler see an ordinary :class:`TorchBackend`.

Failures: a collective that fails (a rank died: its sockets closed) or waits past the
group's timeout (a rank hangs) leaves the ranks out of step for good, so it raises
:class:`FatalBackendError`: the engine fails every live request, /health fails and the
server exits non-zero. While idle, a heartbeat broadcast keeps the other ranks' wait under
the timeout and finds lost ranks early; locally spawned ranks are also watched as processes.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from iron_batch import flags
from iron_batch._core import SchedulerConfig
from iron_batch.backends.base import BackendInfo, FatalBackendError
from iron_batch.backends.torch_backend import TorchBackend, load_tokenizer, pick_device, pick_dtype
from iron_batch.loader import read_config, resolve
from iron_batch.models.partition import TensorParallelError, plan_shards
from iron_batch.parallel import step_broadcast
from iron_batch.parallel.group import DEFAULT_TIMEOUT_S, Rendezvous, joined, serve_store
from iron_batch.parallel.rank import LoadedRank, load_rank, rank_device, share_cores
from iron_batch.parallel.step_broadcast import Message

if TYPE_CHECKING:
    from iron_batch.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class TensorParallelTorchBackend(TorchBackend):
    #: Embeddings read the hidden states on rank 0 alone: not wired through the ranks.
    supports_embeddings = False

    def __init__(
        self,
        loaded: LoadedRank,
        tokenizer: Tokenizer | None,
        *,
        model_name: str,
        kv_block_size: int,
        local_ranks: list[subprocess.Popen[bytes]],
        threads_before: int,
    ) -> None:
        super().__init__(loaded.model, tokenizer, model_name=model_name,
                         num_kv_blocks=loaded.num_kv_blocks, kv_block_size=kv_block_size)
        self.group = loaded.group
        self.tensor_parallel_size = loaded.group.world
        self._local_ranks = local_ranks
        self._threads_before = threads_before
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = threading.Event()
        self._last_message = time.monotonic()
        #: Called (on the heartbeat thread) when the group is found lost while idle; the
        #: server exits non-zero on it. A step that finds it raises FatalBackendError.
        self.on_lost: Callable[[str], None] | None = None
        self._heartbeat = threading.Thread(target=self._beat, name="iron-batch-tp-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        atexit.register(self.close)

    @classmethod
    def from_model(  # type: ignore[override]
        cls,
        model: str,
        *,
        tensor_parallel_size: int,
        device: str = "auto",
        dtype: str = "auto",
        total_kv_blocks: int | None = None,
        kv_block_size: int = SchedulerConfig().kv_block_size,
        kv_cache_memory_gb: float | None = None,
        quantization: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_cache_dtype: str = "auto",
        recurrent_state_dtype: str = "float32",
    ) -> TensorParallelTorchBackend:
        """Rank 0's backend. Outside torchrun the other ranks are spawned here, as
        subprocesses of this one; under torchrun this call on a rank >= 1 runs that rank's
        shard loop and exits the process when rank 0 is done."""
        world = tensor_parallel_size
        source = resolve(model)
        config = read_config(source)
        plan_shards(config, world)  # refuse a world size the model cannot be split by
        if torch.distributed.is_initialized():
            raise TensorParallelError("this process already holds a tensor-parallel model "
                                      "(close it first: LLM.close() / backend.close())")
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev, quantization)
        rendezvous = Rendezvous.from_torchrun_env()
        local_ranks: list[subprocess.Popen[bytes]] = []
        store = None
        if rendezvous is not None:
            if rendezvous.world != world:
                raise TensorParallelError(f"--tensor-parallel-size {world} differs from "
                                          f"torchrun's world size {rendezvous.world}")
        else:
            rendezvous = Rendezvous(0, world, world, 0)
            store = serve_store(world, timeout_s)
            local_ranks = _spawn_local_ranks(
                world, f"127.0.0.1:{store.port}", timeout_s, {
                    "model": model, "device": dev.type, "dtype": str(dt).removeprefix("torch."),
                    "kv_block_size": kv_block_size, "total_kv_blocks": total_kv_blocks,
                    "kv_cache_memory_gb": kv_cache_memory_gb, "quantization": quantization,
                    "kv_cache_dtype": kv_cache_dtype,
                    "recurrent_state_dtype": recurrent_state_dtype,
                })
        dev = rank_device(dev, rendezvous)
        threads_before = share_cores(rendezvous.local_world)
        try:
            if store is not None:
                _wait_until_joined(store, world, local_ranks, timeout_s)
            loaded = load_rank(
                source, config, rendezvous, device=dev, dtype=dt, timeout_s=timeout_s,
                total_kv_blocks=total_kv_blocks, kv_block_size=kv_block_size,
                kv_cache_memory_gb=kv_cache_memory_gb, quantization=quantization, store=store,
                kv_cache_dtype=kv_cache_dtype, recurrent_state_dtype=recurrent_state_dtype)
        except BaseException:
            _stop(local_ranks, 0)
            torch.set_num_threads(threads_before)
            raise
        if rendezvous.rank != 0:
            from iron_batch.parallel.shard_loop import serve

            sys.exit(serve(loaded, kv_block_size))
        return cls(loaded, load_tokenizer(source), model_name=source.name,
                   kv_block_size=kv_block_size, local_ranks=local_ranks,
                   threads_before=threads_before)

    def _logits(self, inputs: dict[str, np.ndarray | torch.Tensor]) -> torch.Tensor:
        # The other ranks get host arrays: placeholders filled on the device (overlap) come
        # back to the host here, so every rank runs the real token ids.
        host = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()}
        if self._failure is None:
            self._check_local_ranks()
        if self._failure is not None:
            raise FatalBackendError(self._failure)
        with self._lock:
            try:
                step_broadcast.send(self.group, Message.STEP, host)
                logits = self.model.forward(**host)
            except Exception as exc:  # the ranks are out of step now, whatever failed
                raise FatalBackendError(self._fail(f"{type(exc).__name__}: {exc}")) from exc
            self._last_message = time.monotonic()
        return logits

    def describe(self) -> BackendInfo:
        info = super().describe()
        return BackendInfo(kind=f"torch, tensor parallel x{self.tensor_parallel_size}",
                           dtype=info.dtype, device=info.device,
                           kv_bytes_per_block=info.kv_bytes_per_block,
                           switches=info.switches, kv_cache_dtype=info.kv_cache_dtype)

    def close(self) -> None:
        """Stop the other ranks (they exit) and leave the group; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._lock.acquire(timeout=self.group.timeout_s):
            try:
                if self._failure is None:
                    try:
                        step_broadcast.send(self.group, Message.STOP)
                    except Exception:
                        logger.warning("tensor parallel: stopping the other ranks failed")
                # Also after a failure, so that this process can build another model.
                self.group.destroy()
            finally:
                self._lock.release()
        _stop(self._local_ranks, 10.0)
        torch.set_num_threads(self._threads_before)
        atexit.unregister(self.close)

    def _fail(self, detail: str) -> str:
        if self._failure is None:
            self._check_local_ranks()
        if self._failure is None:
            self._failure = (f"tensor-parallel group failed (a rank died or passed the "
                             f"{self.group.timeout_s:g}s timeout): {detail}")
        logger.critical("%s", self._failure)
        _stop(self._local_ranks, 0)
        return self._failure

    def _check_local_ranks(self) -> None:
        for rank, proc in enumerate(self._local_ranks, start=1):
            code = proc.poll()
            if code is not None and self._failure is None:
                self._failure = f"tensor-parallel rank {rank} exited with status {code}"

    def _beat(self) -> None:
        interval = max(0.2, self.group.timeout_s / 4)
        while not self._closed.wait(interval / 2):
            with self._lock:
                if self._closed.is_set() or self._failure is not None:
                    return
                self._check_local_ranks()
                if self._failure is None and time.monotonic() - self._last_message >= interval:
                    try:
                        step_broadcast.send(self.group, Message.HEARTBEAT)
                        self._last_message = time.monotonic()
                    except Exception as exc:
                        self._fail(f"heartbeat: {exc}")
                failure = self._failure
            if failure is not None:
                logger.critical("%s", failure)
                _stop(self._local_ranks, 0)
                if self.on_lost is not None:
                    self.on_lost(failure)
                return


def _wait_until_joined(store: Any, world: int, procs: list[subprocess.Popen[bytes]],
                       timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not joined(store, world):
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {code} "
                                   "before joining")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join within {timeout_s:g}s")
        time.sleep(0.02)


def _spawn_local_ranks(
    world: int, store: str, timeout_s: float, model_flags: dict[str, Any]
) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..world-1 as subprocesses, given rank 0's model flags (``flags.MODEL_FLAGS``,
    by destination) as they are."""
    procs = []
    for rank in range(1, world):
        cmd = [sys.executable, "-m", "iron_batch.parallel.shard_loop", "--rank", str(rank),
               "--world-size", str(world), "--store", store, "--timeout", str(timeout_s),
               *flags.to_argv(model_flags)]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait up to ``grace_s`` for each process to end by itself, then kill it."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
