"""The CPU kernel tests run against two builds of the kernels: the native one and the AVX2 one.

An AVX-512 machine builds with `-march=native` the AVX-512 code, so the AVX2 code (8-float halves, 16-column
panels, bf16 widened to float32) would only be tested on an AVX2-only CPU. `-march=haswell` builds exactly
that code here too ($MIXSERVE_KERNEL_MARCH, mixserve/model/cpu/build.py), so every CI run checks both. A test
module opts in with `pytestmark = pytest.mark.usefixtures("kernel_build")`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mixserve.model.cpu import build

# id -> the -march the kernels are built for ("" = the default, native)
BUILDS = {"native": "", "avx2": "haswell"}


@pytest.fixture(scope="module", params=list(BUILDS), ids=list(BUILDS))
def kernel_build(request: pytest.FixtureRequest) -> Iterator[str]:
    """Loads the kernel build named by the param for the module's tests (built once per machine and cached);
    yields its id. The AVX2 build is skipped only where the CPU cannot run AVX2 code."""
    march = BUILDS[request.param]
    if march and "avx2" not in build.cpu_flags().split():
        pytest.skip("the AVX2 build needs a CPU with AVX2")
    with pytest.MonkeyPatch.context() as mp:
        if march:
            mp.setenv("MIXSERVE_KERNEL_MARCH", march)
        else:
            mp.delenv("MIXSERVE_KERNEL_MARCH", raising=False)
        build.reset()
        if build.available() is not None:
            pytest.skip(f"the CPU kernels do not build here: {build.available()}")
        yield request.param
    build.reset()
