"""The `sitsd.kernels` package: importable without triton, wrappers exposed lazily by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_package_and_references_import_without_triton():
    # A fresh interpreter where `import triton` fails, as on the CPU runtime.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None
        import sitsd.kernels
        import sitsd.kernels.reference
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        try:
            sitsd.kernels.decode_attention
        except ImportError as exc:
            assert "needs triton" in str(exc), exc
        else:
            raise AssertionError("accessing a wrapper without triton must raise ImportError")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_wrapper_names_resolve_to_the_wrappers_even_after_importing_their_modules():
    import triton  # noqa: F401

    import sitsd.kernels as kernels
    from sitsd.kernels.decode_attention import choose_num_splits  # binds the submodule
    from sitsd.kernels.gemv import gemv as gemv_fn
    from sitsd.kernels.prefill_attention import prefill_attention as prefill_fn

    assert callable(choose_num_splits)
    assert kernels.prefill_attention is prefill_fn
    assert kernels.gemv is gemv_fn
    for name in kernels.__all__:
        wrapper = getattr(kernels, name)
        assert callable(wrapper)
        assert wrapper.__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'not_a_kernel'"):
        kernels.not_a_kernel  # noqa: B018


def _run_in_checkout(code: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter started in the repository root (it puts that on sys.path,
    as `python -m bench.NAME` and `python -m pytest` do)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_from_the_checkout_the_bare_name_kernels_is_the_installed_distribution():
    # transformers (>= 5) requires the `kernels` distribution and imports it; the repository
    # root's `kernels/` directory made `from transformers import LlamaConfig` fail there.
    result = _run_in_checkout(
        """
        import importlib.metadata
        from transformers import LlamaConfig
        import sitsd.kernels
        print(sitsd.kernels.rms_norm.__module__)
        try:
            importlib.metadata.version("kernels")
        except importlib.metadata.PackageNotFoundError:
            print("-")  # transformers < 5 does not need it
        else:
            import kernels
            print(kernels.__file__)
        """
    )
    assert result.returncode == 0, result.stderr
    wrapper_module, location = result.stdout.split()
    assert wrapper_module == "sitsd.kernels.rmsnorm"
    if location != "-":
        assert not Path(location).resolve().is_relative_to(REPO_ROOT / "kernels")


def test_from_the_checkout_without_the_distribution_the_bare_name_imports_as_before():
    # transformers 4 imports a `kernels` it finds to read its version, and an error from that
    # import stopped `from transformers import LlamaConfig` (every GPU test that compares with
    # transformers failed on the device, which has no `kernels` distribution).
    result = _run_in_checkout(
        """
        import sys
        # Hide every installed `kernels`: only the checkout's directory is left to find.
        sys.path[:] = [p for p in sys.path if p in ("", ".") or "site-packages" not in p]
        import kernels
        print(kernels.__file__, getattr(kernels, "__version__", "N/A"))
        """
    )
    assert result.returncode == 0, result.stderr
    location, version = result.stdout.split()
    assert Path(location).resolve() == REPO_ROOT / "kernels" / "__init__.py"
    assert version == "N/A"
