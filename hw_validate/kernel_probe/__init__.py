"""The kernel probe behind ``python -m hw_validate.gpu_kernels`` (see that module for what it measures and why).

- :mod:`~.plan`    -- the cases read from the published rows and every planned row with moesim's prediction (no torch);
- :mod:`~.sampler` -- SM clock, power, temperature and throttle reasons sampled in a thread (pynvml / nvidia-smi);
- :mod:`~.probe`   -- CUDA-event timing and the BF16 parts: dense, grouped, sustained (torch is handed in);
- :mod:`~.fp8`     -- FP8 GEMMs and casts; :mod:`~.modules` -- SDPA attention and TransformerEngine;
- :mod:`~.report`  -- the summary, the factors that tell the suspects apart, gpu_kernels.{json,md}.
"""
