"""The flags the server, the remote worker and a tensor-parallel rank share are defined once
(``iron_batch.flags``): each program parses them alike, with the same defaults, and rank 0's
values reach a spawned rank intact."""

from __future__ import annotations

import pytest
from iron_batch import flags
from iron_batch.parallel.shard_loop import build_parser as rank_parser
from iron_batch.server.cli import build_parser as server_parser
from iron_batch.worker import build_parser as worker_parser

GIVEN = ["--model", "smollm2-135m", "--device", "cpu", "--dtype", "bfloat16",
         "--quantization", "int4", "--total-kv-blocks", "96", "--kv-block-size", "8",
         "--kv-cache-memory-gb", "0.5"]
RANK = ["--rank", "1", "--world-size", "2", "--store", "127.0.0.1:1", "--timeout", "5"]


def test_the_server_and_the_worker_read_the_model_flags_alike() -> None:
    names = (*flags.MODEL_FLAGS, *flags.DRAFT_FLAGS, "--mock-token-latency-us",
             "--mock-prefill-token-latency-us")
    given = [*GIVEN, "--speculative-model", "smollm2-135m",
             "--speculative-quantization", "int8"]
    server = flags.values(server_parser().parse_args(given), names)
    worker = flags.values(worker_parser().parse_args(given), names)
    assert server == worker
    assert server["quantization"] == "int4" and server["kv_block_size"] == 8
    assert server["speculative_quantization"] == "int8"
    assert flags.values(server_parser().parse_args([]), names) == flags.values(
        worker_parser().parse_args([]), names)


def test_rank_zeros_model_flags_reach_a_spawned_rank_intact() -> None:
    sent = flags.values(server_parser().parse_args(GIVEN), flags.MODEL_FLAGS)
    got = flags.values(rank_parser().parse_args([*RANK, *flags.to_argv(sent)]),
                       flags.MODEL_FLAGS)
    assert got == sent
    # Unset flags stay unset on the rank.
    sparse = {**sent, "quantization": None, "total_kv_blocks": None}
    got = flags.values(rank_parser().parse_args([*RANK, *flags.to_argv(sparse)]),
                       flags.MODEL_FLAGS)
    assert got == sparse


@pytest.mark.parametrize("bad", [["--quantization", "int3"], ["--kv-block-size", "0"],
                                 ["--speculative-quantization", "int3"]])
def test_every_program_refuses_the_same_bad_values(bad: list[str]) -> None:
    for parser in (server_parser(), worker_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
