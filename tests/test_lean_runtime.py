"""`import slimml.runtime` must not pull in torch, transformers, nncf or Ray (an extra)."""

import subprocess
import sys


def test_runtime_import_is_lean():
    code = (
        "import sys, slimml.runtime, slimml.runtime.tools.evaluate, slimml.runtime.tools.bench; "
        "print(','.join(m for m in ('torch', 'transformers', 'nncf', 'optimum', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_info_does_not_import_torch(tmp_path):
    code = "import sys; import slimml.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scale_imports_torch_free():
    code = "import sys, slimml.scale, slimml.serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_onnxruntime_telemetry_is_off_and_writes_nothing(tmp_path):
    """ONNX Runtime's Linux builds phone home by default; slimml turns that off, and with it
    the event store ORT would keep under the home folder."""
    import os

    code = ("import os, slimml.runtime, onnxruntime; from slimml.runtime import load; "
            f"load({str(_tiny_artifact(tmp_path))!r}); print(os.environ['ORT_DISABLE_TELEMETRY'])")
    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "1"
    assert not any((tmp_path / "home").rglob("*"))


def _tiny_artifact(tmp_path):
    from conftest import tiny_onnx_mlp

    from slimml.convert import ConvertConfig, convert

    out = tmp_path / "art"
    convert(tiny_onnx_mlp(tmp_path / "mlp.onnx"), out, ConvertConfig(measure_latency=False, verify=False))
    return out
