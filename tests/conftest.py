"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

# LLVM at -O0: the suite is compile-bound (tiny models, hundreds of programs), and the backend level
# changes only the machine code XLA emits, not the HLO passes, the buffer assignment or the collectives the
# tests check (docs/internals.md, "Test suite"). Subprocesses inherit them.
_TEST_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
_OURS = {flag.split("=")[0] for flag in _TEST_FLAGS}
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in _OURS] + list(_TEST_FLAGS))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One profile cache for the whole run (shared by xdist workers, which inherit the controller's environment):
# the same tiny models are analysed by many test files, and a hit skips the symbolic analysis.
if "MISTJAX_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MISTJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="mistjax-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def zoo3p():
    """Third-party-style model families and their plain optax train steps (tests/thirdparty.py)."""
    import thirdparty

    return thirdparty


@pytest.fixture(scope="session")
def family(zoo3p):
    """``family(name)``: a built third-party model family (cached; skips when transformers is absent)."""
    built = {}

    def get(name: str):
        if name in zoo3p.HF_FAMILIES and not zoo3p.hf_available():
            pytest.skip("transformers is not installed (pip install -e '.[dev]' brings transformers<5)")
        if name not in built:
            built[name] = zoo3p.FAMILIES[name]()
        return built[name]

    return get



@pytest.fixture
def hf_config_file(tmp_path):
    """``hf_config_file(doc, folder="model")``: writes a Hugging Face config dict to ``<tmp>/<folder>/config.json``
    (the layout of a downloaded checkpoint) and returns the path."""
    import json

    def write(doc: dict, folder: str = "model"):
        path = tmp_path / folder / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc))
        return path

    return write
