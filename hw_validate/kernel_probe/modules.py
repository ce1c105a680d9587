"""Parts d and f of the probe: SDPA attention (flash, cuDNN) and TransformerEngine's GroupedLinear,
as methods of :class:`hw_validate.kernel_probe.probe.Probe`."""

from __future__ import annotations

import contextlib

from hw_validate.kernel_probe.plan import AttnCase, ExpertCase


class ModuleParts:
    # -- part d ----------------------------------------------------------------------------------
    def run_attention(self, a: AttnCase) -> None:
        torch = self.torch
        import torch.nn.functional as F

        rows = [r for r in self.find(part="d") if r["published_rows"] == [a.row]]
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except Exception as exc:  # noqa: BLE001
            self.fail(rows, exc)
            return
        try:
            shape = (a.batch, a.heads, a.seq, a.head_dim)
            q, k, v = (
                torch.randn(shape, device=self.device, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            go = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        except Exception as exc:  # noqa: BLE001
            self.fail(rows, exc)
            return
        backends = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
        for r in rows:
            self.log(f"  d {r['impl']} {r['role']} {r['shape']}")
            be = getattr(SDPBackend, backends[r["impl"]], None)
            if be is None:
                r["error"] = f"skipped: torch has no SDPBackend.{backends[r['impl']]}"
                continue

            def fwd(be=be, q=q, k=k, v=v):  # with grad enabled, as a training forward (the graph is dropped)
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd(be=be, q=q, k=k, v=v, go=go):
                with sdpa_kernel([be]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    return torch.autograd.grad(o, (q, k, v), go)

            self.burst(r, fwd if r["role"].endswith(".fwd") else fwd_bwd)
        del q, k, v, go
        if self.cuda:
            torch.cuda.empty_cache()

    # -- part f ----------------------------------------------------------------------------------
    def run_te(self, c: ExpertCase) -> None:
        torch = self.torch
        rows = self.find(case=c.name, part="f")
        if not rows:
            return
        try:
            import transformer_engine  # noqa: F401
            import transformer_engine.pytorch as te
        except Exception as exc:  # noqa: BLE001
            for r in rows:
                r["error"] = f"unavailable: transformer_engine not importable ({type(exc).__name__})"
            return
        if not self.cuda:
            for r in rows:
                r["error"] = "skipped: TransformerEngine needs CUDA"
            return
        recipe = None
        try:
            from transformer_engine.common.recipe import Float8BlockScaling

            recipe = Float8BlockScaling()
        except Exception as exc:  # noqa: BLE001
            recipe = exc
        autocast = getattr(te, "fp8_autocast", None) or getattr(te, "autocast", None)
        G, m = c.experts, c.tokens
        for g in c.gemms:
            layer = inp = go = None
            for r in self.find(case=c.name, part="f", role=f"{g.name}.fwd") + self.find(
                case=c.name, part="f", role=f"{g.name}.fwd+bwd"
            ):
                self.log(f"  f {r['impl']} {r['role']}")
                try:
                    if layer is None:
                        layer = te.GroupedLinear(
                            G, g.k, g.n, bias=False, params_dtype=torch.bfloat16, device="cuda"
                        )
                        inp = torch.randn(
                            G * m, g.k, device=self.device, dtype=torch.bfloat16, requires_grad=True
                        )
                        go = torch.randn(G * m, g.n, device=self.device, dtype=torch.bfloat16)
                    fp8 = r["dtype"] == "fp8"
                    if fp8 and isinstance(recipe, BaseException):
                        raise recipe
                    splits = [m] * G

                    def ctx(fp8=fp8):
                        return autocast(enabled=True, fp8_recipe=recipe) if fp8 else contextlib.nullcontext()

                    if r["role"].endswith(".fwd"):

                        def fn(ctx=ctx, layer=layer, inp=inp, splits=splits):
                            with ctx():  # grad enabled: a training forward (FP8: column-wise copies too)
                                return layer(inp, splits)
                    else:

                        def fn(ctx=ctx, layer=layer, inp=inp, splits=splits, go=go):
                            with ctx():
                                out = layer(inp, splits)
                            out.backward(go)
                            for p in layer.parameters():
                                p.grad = None
                            inp.grad = None

                    self.burst(r, fn)
                except Exception as exc:  # noqa: BLE001
                    self.fail([r], exc)
            del layer, inp, go
        torch.cuda.empty_cache()
