"""`import slimml.runtime` must not pull in torch, transformers, nncf or Ray (an extra)."""

import subprocess
import sys


def test_runtime_import_is_lean():
    code = (
        "import sys, slimml.runtime, slimml.runtime.evaluate, slimml.runtime.bench; "
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
