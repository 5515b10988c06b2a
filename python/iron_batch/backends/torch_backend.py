"""Backend that runs a torch model of ``iron_batch.models`` over the scheduler's paged
batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from iron_batch._core import CacheGroup, SchedulerConfig, split_pool
from iron_batch.backends.base import BackendBase, BackendInfo, StepOutput
from iron_batch.batch import (
    absolute_block_tables,
    group_model_inputs,
    model_inputs,
    state_model_inputs,
)
from iron_batch.draft_model import DraftRunner, check_draft
from iron_batch.loader import ModelSource, load_model, read_gguf_fields, resolve
from iron_batch.models.decoder import DecoderModel
from iron_batch.pooling import PromptPooler
from iron_batch.prompt_logprobs import PromptLogprobs, PromptScorer
from iron_batch.sampling import RequestState, Sampler
from iron_batch.sampling_params import SamplingParams
from iron_batch.speculative import verify_rows
from iron_batch.stream import StepLogprobs
from iron_batch.structured.masking import GrammarMasker, llguidance_installed
from iron_batch.tokenizer import Tokenizer

if TYPE_CHECKING:
    from iron_batch._core import Batch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

#: The Rust core's defaults (the KV block size).
_CORE_DEFAULTS = SchedulerConfig()

# KV pool size when neither a block count nor a memory budget is given, on CPU.
_DEFAULT_CPU_KV_GB = 1.0
# The context length the groups of a hybrid pool are sized to serve alike.
_SPLIT_CONTEXT = 8192
# Share of free GPU memory (after weights) given to the KV pool by default.
_CUDA_KV_FRACTION = 0.85


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    if dtype == "auto":
        # CPU: float32 (bf16 GEMMs are only fast on some CPUs and lose exactness vs. HF),
        # but quantized weights compute with bf16 activations.
        if device.type != "cuda":
            return torch.bfloat16 if quantization else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


@dataclass
class TorchStep:
    """A submitted step: its sampled tokens, still on the device until ``wait``."""

    tokens: torch.Tensor | None
    logprobs: StepLogprobs | None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    embeddings: dict[str, np.ndarray] | None = None
    #: A step that verified proposals: tokens accepted per sample row (``tokens`` flat).
    num_accepted: np.ndarray | None = None


_NO_TOKENS = np.zeros(0, dtype=np.int64)


class TorchBackend(BackendBase):
    """Runs each scheduler batch in one forward pass and samples one token per sample row.

    ``submit`` launches the step and keeps its sampled tokens on the device: the next
    step's placeholders are filled in from them there, with no copy to the host in between
    (on CUDA, kernels queue while the engine schedules; on CPU the work runs in ``submit``
    itself, so the engine keeps no step in flight there by default). ``wait`` copies the
    tokens to the host.
    """

    supports_prompt_logprobs = True
    supports_embeddings = True

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer | None,
        *,
        model_name: str,
        num_kv_blocks: int | list[int],
        kv_block_size: int,
        draft: DecoderModel | None = None,
    ) -> None:
        """``num_kv_blocks``: the KV pool in blocks, of each cache group (a list: one count
        per ``model.cache_groups`` entry). ``draft``: a draft model for speculative
        decoding (``speculative_method="draft"``; see :mod:`iron_batch.draft_model`), with
        its own KV of the same blocks."""
        self.model = model
        # torch CPU ops run to the end when called; CUDA ones are queued on a stream.
        self.asynchronous_submit = model.device.type == "cuda"
        self.tokenizer = tokenizer
        self.model_name = model_name
        groups = model.cache_groups
        per_group = (list(num_kv_blocks) if isinstance(num_kv_blocks, list)
                     else [num_kv_blocks] * len(groups))
        self.num_kv_blocks: int = per_group[0]
        self.kv_block_size: int = kv_block_size
        self.max_model_len: int | None = model.config.max_position_embeddings
        #: The scheduler's cache groups (empty: one full-attention group of
        #: ``num_kv_blocks``): a sliding group releases the blocks before its window.
        self.cache_groups: list[CacheGroup] = []
        if groups != [("full", None)]:
            unit = [model.state_slot_bytes() if kind == "state" else b * kv_block_size
                    for (kind, _), b in zip(groups, model.kv_bytes_per_token(), strict=True)]
            self.cache_groups = [CacheGroup(kind, size, window=window, unit_bytes=u)
                                 for (kind, window), size, u in zip(groups, per_group, unit,
                                                                    strict=True)]
        # The attention groups' pools (a state group's slots are the model's to check).
        self._group_blocks = [n for (kind, _), n in zip(groups, per_group, strict=True)
                              if kind != "state"]
        self._has_state = any(kind == "state" for kind, _ in groups)
        self.vocab_size = model.config.vocab_size
        eos = list(model.config.eos_token_ids)
        for i in tokenizer.eos_token_ids if tokenizer else []:
            if i not in eos:
                eos.append(i)
        self.eos_token_ids = eos
        model.allocate_kv_cache(per_group, kv_block_size)
        #: The draft model's runner (``speculative_method`` "draft"), or None.
        self.draft: DraftRunner | None = None
        if draft is not None:
            self.draft = DraftRunner(draft)
            self.draft.allocate_kv_cache(per_group[0], kv_block_size)
        # With a draft model loaded it fills every proposal row (prompt lookup's would be
        # overwritten), so the draft is then the one method.
        self.speculative_methods: tuple[str, ...] = (
            ("draft",) if draft is not None else ("ngram",))
        grammar = None
        if tokenizer is not None and llguidance_installed():
            grammar = GrammarMasker(tokenizer, model.config.vocab_size, eos)
        self.supports_structured_output = grammar is not None
        self.sampler = Sampler(model.config.vocab_size, model.device, grammar)
        self._requests: dict[str, RequestState] = {}
        self.scorer = PromptScorer()
        self.pooler = PromptPooler()
        # The last submitted step's sampled tokens, on the device.
        self._device_tokens: torch.Tensor | None = None

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        total_kv_blocks: int | None = None,
        kv_block_size: int = _CORE_DEFAULTS.kv_block_size,
        kv_cache_memory_gb: float | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        recurrent_state_dtype: str = "float32",
        speculative_model: str | None = None,
        speculative_quantization: str | None = None,
    ) -> TorchBackend:
        """``kv_cache_dtype``: "auto" (K/V in the model's dtype) or "int8" (see
        ``attention/kv_int8.py``); the memory budget counts the bytes of that layout, and
        of the recurrent states in ``recurrent_state_dtype`` (float32 or bfloat16).
        ``speculative_model``: a draft model (same tokenizer) for speculative decoding,
        quantized as ``speculative_quantization`` says; its KV counts in the budget."""
        source = resolve(model)
        dev = pick_device(device)
        net = load_model(source, device=dev, dtype=pick_dtype(dtype, dev, quantization),
                         quantization=quantization)
        net.set_kv_cache_dtype(kv_cache_dtype)
        net.set_state_dtype(recurrent_state_dtype)
        draft = None
        if speculative_model is not None:
            draft_source = resolve(speculative_model)
            draft = load_model(draft_source, device=dev,
                               dtype=pick_dtype(dtype, dev, speculative_quantization),
                               quantization=speculative_quantization)
            draft.set_kv_cache_dtype(kv_cache_dtype)
            check_draft(net, load_tokenizer(source), draft, load_tokenizer(draft_source))
        blocks: int | list[int]
        if total_kv_blocks is not None:
            blocks = total_kv_blocks
            if any(kind == "state" for kind, _ in net.cache_groups):
                blocks = [state_slots_for(net, total_kv_blocks, kv_cache_memory_gb)
                          if kind == "state" else total_kv_blocks
                          for kind, _ in net.cache_groups]
        elif len(net.cache_groups) > 1:
            blocks = group_blocks_for_memory(net, kv_block_size, kv_cache_memory_gb)
        else:
            blocks = kv_blocks_for_memory(net, kv_block_size, kv_cache_memory_gb, draft)
        return cls(
            net,
            load_tokenizer(source),
            model_name=source.name,
            num_kv_blocks=blocks,
            kv_block_size=kv_block_size,
            draft=draft,
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        # An id past the embedding table would fail the whole step for every request in it:
        # refuse it here, where the engine turns the error into a rejection of this one.
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        self._requests[request_id] = self.sampler.new_state(prompt_token_ids, params)
        self.scorer.add_request(request_id, prompt_token_ids, params.prompt_logprobs)
        self.pooler.add_request(request_id, len(prompt_token_ids), params.embed)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if self.draft is not None:
            self.draft.remove_request(request_id)
        self.scorer.remove_request(request_id)
        self.pooler.remove_request(request_id)

    def execute(self, batch: Batch) -> np.ndarray:
        return self.wait(self.submit(batch)).tokens

    def submit(self, batch: Batch) -> TorchStep:
        try:
            return self._submit(batch)
        except BaseException:
            self._device_tokens = None
            raise

    def _submit(self, batch: Batch) -> TorchStep:
        if batch.num_seqs == 0:
            self._device_tokens = None
            return TorchStep(None, None)
        if batch.block_tables.size and int(batch.block_tables.max()) >= self.num_kv_blocks:
            raise ValueError("batch uses a KV block id beyond this backend's num_kv_blocks")
        inputs: dict[str, np.ndarray | torch.Tensor] = dict(model_inputs(batch))
        offsets = getattr(batch, "block_table_offsets", None)
        if offsets is not None and offsets.size and offsets[0].any():
            # A sliding group's tables start at their offsets; the attention indexes them by
            # position and its window mask hides the released columns.
            inputs["block_tables"] = absolute_block_tables(batch.block_tables, offsets[0])
        if len(self._group_blocks) > 1:
            inputs.update(group_model_inputs(batch, self._group_blocks))
        if self._has_state:
            inputs.update(state_model_inputs(batch))
        holes = getattr(batch, "pending_token_indices", None)
        if holes is not None and len(holes):
            # Placeholders are filled before the forward (and before a tensor-parallel
            # backend broadcasts the inputs), from the previous step's tokens on the device.
            prev = self._device_tokens
            rows = batch.pending_sample_rows
            if prev is None or int(rows.max()) >= len(prev):
                raise ValueError("the batch has placeholders but no previous step sampled them")
            dev = self.model.device
            ids = torch.from_numpy(np.ascontiguousarray(batch.input_ids, dtype=np.int64)).to(dev)
            ids[torch.from_numpy(holes).to(dev)] = prev[torch.from_numpy(rows).to(dev)]
            inputs["input_ids"] = ids
        proposed = getattr(batch, "num_proposed", None)
        speculating = proposed is not None and bool(proposed.any())
        if self.draft is not None:
            # The draft fills the proposal rows (and keeps its KV of every row).
            inputs["input_ids"] = self.draft.fill(batch, inputs["input_ids"],
                                                  self.vocab_size)
        scoring = self.scorer.rows(batch)
        sample_rows = np.asarray(batch.sample_indices, dtype=np.int64)
        if speculating:
            # A row with k proposals is verified by the logits of its last k + 1 rows.
            k = proposed.astype(np.int64)
            sample_rows = np.repeat(sample_rows - k, k + 1) + _ranks(k + 1)
            inputs["sample_indices"] = sample_rows
        num_samples = len(sample_rows)
        if scoring is not None:
            # The scored prompt rows ride along behind the sample rows through the LM head.
            inputs["sample_indices"] = np.concatenate([sample_rows, scoring.rows])
        pooling = self.pooler.rows(batch) if self.supports_embeddings else None
        if pooling is not None:
            logits, hidden = self.model.forward_with_hidden(pooling.rows, **inputs)
            self.pooler.record(hidden, pooling)
        else:
            logits = self._logits(inputs)
        if scoring is not None:
            self.scorer.record(logits[num_samples:], scoring)
            logits = logits[:num_samples]
        rids = batch.sample_request_ids
        states = [self._state(rid) for rid in rids]
        if not states:
            self._device_tokens = None
            return TorchStep(None, None)
        if speculating:
            return self._verify(batch, logits, states, rids, inputs["input_ids"])
        tokens, logprobs = self.sampler.sample(logits, states)
        self._device_tokens = tokens
        # Requests sampling here have their prompt computed: their scores and pooled hidden
        # states are complete.
        return TorchStep(tokens, logprobs, self.scorer.take_finished(rids),
                         self.pooler.take_finished(rids))

    def _verify(
        self, batch: Batch, logits: torch.Tensor, states: list[RequestState], rids: list[str],
        input_ids: np.ndarray | torch.Tensor,
    ) -> TorchStep:
        """Sample the rows without proposals as usual and verify the others (see
        :mod:`iron_batch.speculative`); the tokens come back flat with a count per row.
        ``input_ids``: the step's ids, proposals (and placeholders) filled in."""
        k = batch.num_proposed.tolist()
        first = np.cumsum([0, *[1 + x for x in k]])[:-1]
        plain = [r for r, x in enumerate(k) if x == 0]
        spec = [r for r, x in enumerate(k) if x > 0]
        per_row: list[list[int]] = [[] for _ in k]
        # Logprobs per row, one per accepted token (None: nobody asked).
        row_logprobs: list[StepLogprobs] | None = None
        if plain:
            idx = torch.from_numpy(first[plain]).to(logits.device)
            toks, plain_logprobs = self.sampler.sample(logits[idx], [states[r] for r in plain])
            for r, t in zip(plain, toks.tolist(), strict=True):
                per_row[r] = [t]
            if plain_logprobs is not None:
                row_logprobs = [[] for _ in k]
                for r, lp in zip(plain, plain_logprobs, strict=True):
                    row_logprobs[r] = [lp]
        ids = (input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor)
               else np.asarray(input_ids))
        ends = batch.sample_indices
        proposals = [ids[int(ends[r]) - k[r] + 1 : int(ends[r]) + 1] for r in spec]
        if not plain:
            spec_logits = logits  # every row verifies (a lone sequence's step)
        else:
            rows = np.concatenate([first[r] + np.arange(k[r] + 1) for r in spec])
            spec_logits = logits[torch.from_numpy(rows)]
        toks, counts, spec_logprobs = verify_rows(
            self.sampler, spec_logits, [states[r] for r in spec], proposals)
        if spec_logprobs is not None and row_logprobs is None:
            row_logprobs = [[] for _ in k]
        at = 0
        for r, c in zip(spec, counts, strict=True):
            per_row[r] = toks[at : at + c]
            if row_logprobs is not None:
                row_logprobs[r] = (spec_logprobs[at : at + c] if spec_logprobs is not None
                                   else [(0.0, [])] * c)
            at += c
            if self.draft is not None and c == k[r] + 1:
                end = int(ends[r])
                self.draft.note_accepted(rids[r], int(batch.positions[end]), int(ids[end]))
        flat = [t for row in per_row for t in row]
        logprobs = None
        if row_logprobs is not None:
            # One entry per token of ``flat`` (rows without logprobs get empty ones).
            logprobs = [lp for r, row in enumerate(per_row)
                        for lp in (row_logprobs[r] or [(0.0, [])] * len(row))]
        self._device_tokens = torch.tensor([row[-1] for row in per_row], dtype=torch.int64,
                                           device=self.model.device)
        return TorchStep(torch.tensor(flat, dtype=torch.int64), logprobs,
                         self.scorer.take_finished(rids), self.pooler.take_finished(rids),
                         np.array([len(row) for row in per_row], dtype=np.int64))

    def wait(self, handle: TorchStep) -> StepOutput:
        if handle.tokens is None:
            return StepOutput(_NO_TOKENS)
        tokens = handle.tokens.cpu().numpy().astype(np.int64, copy=False)
        return StepOutput(tokens, handle.logprobs, handle.prompt_logprobs, handle.embeddings,
                          handle.num_accepted)

    def _logits(self, inputs: dict[str, np.ndarray | torch.Tensor]) -> torch.Tensor:
        """Float32 logits of the rows ``inputs["sample_indices"]`` names, from one forward
        over the model inputs (tensor parallelism overrides this). Placeholders are already
        filled: ``inputs["input_ids"]`` may then be a device tensor."""
        return self.model.forward(**inputs)

    def describe(self) -> BackendInfo:
        net = self.model
        return BackendInfo(
            kind="torch",
            dtype=str(net.dtype).removeprefix("torch."),
            device=str(net.device),
            kv_bytes_per_block=net.kv_bytes_per_block(self.kv_block_size),
            switches=net.switches.as_dict(),
            kv_cache_dtype=kv_cache_dtype_name(net),
        )

    def _state(self, request_id: str) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            # Scheduler-only users may skip add_request: sample greedily for them.
            state = self.sampler.new_state([], SamplingParams())
            self._requests[request_id] = state
        return state


def kv_cache_dtype_name(net: DecoderModel) -> str:
    """What the model's KV cache holds: "int8", or the model's dtype ("bfloat16")."""
    if net.kv_cache_dtype == "int8":
        return "int8"
    return str(net.dtype).removeprefix("torch.")


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """0, 1, .., n - 1 for each n of ``lengths``, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts


def kv_blocks_for_memory(
    net: DecoderModel, block_size: int, memory_gb: float | None,
    draft: DecoderModel | None = None,
) -> int:
    """KV blocks in the budget; with a ``draft`` model, each block holds its KV too."""
    per_block = net.kv_bytes_per_block(block_size)
    if draft is not None:
        per_block += draft.kv_bytes_per_block(block_size)
    if memory_gb is None:
        if net.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(net.device)
            budget = free * _CUDA_KV_FRACTION
        else:
            budget = _DEFAULT_CPU_KV_GB * 2**30
    else:
        budget = memory_gb * 2**30
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError("KV cache memory budget is smaller than one block")
    return blocks


def state_slots_for(net: DecoderModel, total_kv_blocks: int, memory_gb: float | None) -> int:
    """State slots beside ``total_kv_blocks`` KV blocks: as many (two per running sequence
    at most), within half the memory budget."""
    budget = (memory_gb if memory_gb is not None else _DEFAULT_CPU_KV_GB) * 2**30
    fit = int(budget // 2 // max(1, net.state_slot_bytes()))
    return max(2, min(total_kv_blocks, 2 * _CORE_DEFAULTS.max_running_seqs, fit))


def group_blocks_for_memory(
    net: DecoderModel, block_size: int, memory_gb: float | None
) -> list[int]:
    """Blocks of each cache group from one memory budget, split by the core so that each
    group serves as many sequences of ``_SPLIT_CONTEXT`` tokens. A sliding group is sized
    for what a decoding sequence holds (its window and a block): the step's prompt chunk
    is shared by the few sequences in prefill, not held by every one."""
    budget = kv_blocks_for_memory(net, block_size, memory_gb) * net.kv_bytes_per_block(
        block_size)
    specs = [(kind, window, net.state_slot_bytes() if kind == "state" else per_token)
             for (kind, window), per_token
             in zip(net.cache_groups, net.kv_bytes_per_token(), strict=True)]
    context = min(net.config.max_position_embeddings, _SPLIT_CONTEXT)
    running = _CORE_DEFAULTS.max_running_seqs
    if any(kind == "state" for kind, _ in net.cache_groups):
        # Two state slots per running sequence (its own and a checkpoint): at most half
        # the budget, so that the attention groups keep the rest.
        running = max(1, min(running, int(budget // (4 * max(1, net.state_slot_bytes())))))
    groups = split_pool(budget, specs, block_size, running, context, block_size)
    return [g.size for g in groups]


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    if source.gguf is not None:
        return Tokenizer.from_gguf_fields(read_gguf_fields(source.gguf))
    if (source.folder / "tokenizer.json").is_file():
        return Tokenizer.from_folder(source.folder)
    return None
