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
