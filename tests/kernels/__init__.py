"""Tests of the Triton kernels in `sitsd.kernels` against `sitsd.kernels.reference`."""
