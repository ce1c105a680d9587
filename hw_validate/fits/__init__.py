"""The fits of ``moesim calibrate``, one module per thing fitted, each through the simulator's own
formula so that the fitted numbers reproduce the measurements when the simulator uses them:
:mod:`~hw_validate.fits.links` (link latency and bandwidth, bytes factors of the other collectives),
:mod:`~hw_validate.fits.compute` (GEMM roofline, memory bandwidth, attention efficiency),
:mod:`~hw_validate.fits.optimizer` (optimizer step, ZeRO's gradient hooks),
:mod:`~hw_validate.fits.dispatcher` (DeepSpeed's token dispatcher),
:mod:`~hw_validate.fits.cpu_ranks` (CPU ranks' compute noise, late wake-ups and stalls) and
:mod:`~hw_validate.fits.reference_job` (in-job compute scale and call overhead, by simulating the
reference job as it ran). :func:`hw_validate.calibrate_fit.fit_all` runs them in turn on a
microbenchmark result. Nothing here imports torch.
"""
