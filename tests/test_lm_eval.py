"""EleutherAI's lm-evaluation-harness against the server, as its users run it.

A small multiple-choice task (``tests/data/tiny_mc.jsonl``, loaded by the harness's local
JSON dataset path; nothing comes from a hub) is scored by ``local-completions`` pointed at
our server, which tokenizes through the server's own ``/tokenizer_info`` and ``/tokenize``
(the harness's remote-tokenizer mode) and scores with ``echo`` + ``logprobs``; then by the
harness's ``hf`` model (transformers) on the same weights. Accuracies must be equal, and
every per-choice loglikelihood must agree.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval  # noqa: F401  (a test dependency: pip install '.[test]')
import pytest
from conftest import ServerHandle, ServerStarter
from iron_batch.backends.torch_backend import TorchBackend
from tiny_models import checkpoint

DATA = Path(__file__).parent / "data" / "tiny_mc.jsonl"
TASK = "iron_batch_tiny_mc"


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No hub: datasets and transformers read local files only, caches in a temp dir."""
    root = tmp_path_factory.mktemp("lm_eval")
    mp = pytest.MonkeyPatch()
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("TRANSFORMERS_OFFLINE", "1"), ("HF_HOME", str(root / "hf")),
                        ("HF_DATASETS_CACHE", str(root / "datasets"))):
        mp.setenv(name, value)
    # The libraries read those variables when first imported (transformers already is):
    # set what they read from them too.
    import datasets.config
    import huggingface_hub.constants

    for module, name, value in (
        (datasets.config, "HF_DATASETS_OFFLINE", True),
        (datasets.config, "HF_HUB_OFFLINE", True),
        (datasets.config, "HF_DATASETS_CACHE", root / "datasets"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE", True),
    ):
        mp.setattr(module, name, value)
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def model_dir(offline: Path) -> Path:
    """The tiny Llama checkpoint, its tokenizer marked as a plain fast tokenizer so that
    transformers' AutoTokenizer reads tokenizer.json as it is (as the server does)."""
    folder = offline / "tiny-llama"
    shutil.copytree(checkpoint("llama"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def task_dir(offline: Path) -> Path:
    folder = offline / "tasks"
    folder.mkdir()
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {json.dumps(str(DATA))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n"
        "  - metric: acc\n"
        "  - metric: acc_norm\n"
    )
    return folder


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerHandle]:
    be = TorchBackend.from_model(str(model_dir), device="cpu", dtype="float32",
                                 total_kv_blocks=512, kv_block_size=4)
    starter = ServerStarter()
    # A small token budget: the harness's prompts are scored over several prefill chunks.
    yield starter(be, total_kv_blocks=be.num_kv_blocks, kv_block_size=be.kv_block_size,
                  max_model_len=be.max_model_len, max_batch_tokens=16)
    starter.close()


def evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    return dict(out)


def loglikelihoods(out: dict[str, Any]) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc, choice) -> (loglikelihood, is_greedy) from the harness's logged samples."""
    got = {}
    for sample in out["samples"][TASK]:
        for choice, resp in enumerate(sample["resps"]):
            ll, greedy = resp[0]
            got[(sample["doc_id"], choice)] = (float(ll), bool(greedy))
    return got


def test_lm_eval_local_completions_matches_the_hf_model(
    server: ServerHandle, model_dir: Path, task_dir: Path
) -> None:
    from lm_eval.utils import check_remote_tokenizer_support

    base_url = f"{server.url}/v1/completions"
    # The harness's own probe of our tokenizer endpoints: it picks the remote tokenizer.
    assert check_remote_tokenizer_support(base_url)
    ours = evaluate("local-completions", {
        "model": "tiny-llama", "base_url": base_url, "tokenizer_backend": "remote",
        "num_concurrent": 2, "batch_size": 4, "max_retries": 1,
    }, task_dir)
    # The remote tokenizer encodes without special tokens; the hf model would add the
    # tokenizer's BOS unless told not to. Same token sequences on both sides.
    theirs = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32",
                             "device": "cpu", "batch_size": 4, "add_bos_token": False},
                      task_dir)
    ours_ll, theirs_ll = loglikelihoods(ours), loglikelihoods(theirs)
    assert len(ours_ll) == 80 and ours_ll.keys() == theirs_ll.keys()
    for key, (ll, greedy) in ours_ll.items():
        assert ll == pytest.approx(theirs_ll[key][0], abs=1e-3), key
        assert greedy == theirs_ll[key][1], key
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASK][metric] == theirs["results"][TASK][metric], metric
    server.wait_idle()
