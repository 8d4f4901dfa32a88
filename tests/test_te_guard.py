"""A half-installed Transformer Engine (present, but raising RuntimeError on import) must not break
``import megatron.core``: ``megatron_grpo`` hides it before Megatron's first import."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = """
import megatron_grpo, megatron.core
from megatron.core.models.gpt import gpt_layer_specs
from megatron_grpo.models.spec import layer_spec, te_usable
from megatron_grpo.te_guard import broken
spec, backend = layer_spec(None)
print("OK", backend, te_usable(), broken)
"""


def test_broken_transformer_engine_is_hidden_before_megatron_imports(tmp_path):
    te = tmp_path / "transformer_engine"
    te.mkdir()
    (te / "__init__.py").write_text('raise RuntimeError("libtransformer_engine.so: cannot open shared object file")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    bare = subprocess.run([sys.executable, "-c", "import megatron.core.models.gpt.gpt_layer_specs"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "libtransformer_engine.so" in bare.stderr  # Megatron alone breaks
    guarded = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert "OK local False RuntimeError: libtransformer_engine.so" in guarded.stdout
    assert "Transformer Engine is installed but does not import" in guarded.stderr
