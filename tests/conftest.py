"""Test configuration: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
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
