"""Part c of the probe: FP8 GEMMs (per-tensor, 1x128 / 128x128 blocks, grouped row-wise) and the
BF16 -> FP8 casts of their inputs, as methods of :class:`hw_validate.kernel_probe.probe.Probe`."""

from __future__ import annotations

from hw_validate.kernel_probe.plan import ROLES, ExpertCase

FP8_MAX = 448.0  # E4M3


class Fp8Parts:
    # -- part c ----------------------------------------------------------------------------------
    def run_fp8(self, c: ExpertCase) -> None:
        torch = self.torch
        rows = [r for r in self.find(case=c.name, part="c")]
        if not rows:
            return
        if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
            for r in rows:
                r["error"] = "skipped: this torch has no float8 / _scaled_mm"
            return
        if self.cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            for r in rows:
                r["error"] = "skipped: FP8 needs compute capability >= 8.9"
            return
        try:
            t = self.tensors(c, "randn")
        except Exception as exc:  # noqa: BLE001
            self.fail(rows, exc)
            return
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        one = torch.ones((), device=self.device, dtype=torch.float32)
        m, G = c.tokens, c.experts
        for g in c.gemms:
            X, W, DY = t[g.name]["X"], t[g.name]["W"], t[g.name]["DY"]
            try:  # FP8 operands, laid out as _scaled_mm wants them (a row-major, b column-major)
                x8, w8 = X[:m].to(e4), W[0].to(e4)
                wt8 = W[0].t().contiguous().to(e4)  # [k, n]: TE keeps this transposed copy for dgrad
                xt8 = X[:m].t().contiguous().to(e4)  # [k, m]
                dy8 = {dt: DY[:m].to(dt) for dt in (e5, e4)}
                dyc8 = {dt: DY[:m].t().contiguous().to(dt).t() for dt in (e5, e4)}  # [m, n] column-major
            except Exception as exc:  # noqa: BLE001
                self.fail([r for r in rows if r["role"].startswith(g.name)], exc)
                continue
            operands = {
                "fwd": [((x8, w8.t()), "e4m3 x e4m3")],
                "dgrad": [((dy8[e5], wt8.t()), "e5m2 x e4m3 (hybrid)"), ((dy8[e4], wt8.t()), "e4m3 x e4m3")],
                "wgrad": [((xt8, dyc8[e5]), "e4m3 x e5m2 (hybrid)"), ((xt8, dyc8[e4]), "e4m3 x e4m3")],
            }
            for role in ROLES:
                for r in self.find(case=c.name, impl="fp8_tensor", role=f"{g.name}.{role}"):
                    self.log(f"  c fp8 per-tensor {r['role']} {r['shape']}")
                    # TE accumulates the forward GEMM fast (no split accumulator), dgrad and wgrad in full
                    self._scaled(r, operands[role], lambda a, b: (one, one), fast=role == "fwd")
                for r in self.find(case=c.name, impl="fp8_block", role=f"{g.name}.{role}"):
                    self.log(f"  c fp8 blockwise {r['role']} {r['shape']}")
                    self._blockwise(r, operands[role], role)
            # grouped, row-wise scales (forward and dgrad: 2D x 3D)
            for role in ("fwd", "dgrad"):
                for r in self.find(case=c.name, impl="fp8_grouped", role=f"{g.name}.{role}"):
                    self.log(f"  c fp8 grouped {r['role']}")
                    try:
                        if not hasattr(torch, "_scaled_grouped_mm"):
                            raise RuntimeError("this torch has no _scaled_grouped_mm")
                        if role == "fwd":
                            a8, b8 = X.to(e4), W.to(e4).transpose(-2, -1)  # [G, k, n] column-major
                        else:
                            a8, b8 = DY.to(e4), W.transpose(-2, -1).contiguous().to(e4).transpose(-2, -1)
                        sa = torch.ones(a8.shape[0], device=self.device, dtype=torch.float32)
                        sb = torch.ones(G, b8.shape[-1], device=self.device, dtype=torch.float32)
                        offs = t["offs"]

                        def fn(a8=a8, b8=b8, sa=sa, sb=sb, offs=offs):
                            return torch._scaled_grouped_mm(
                                a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16
                            )

                        self.burst(r, fn)
                        del a8, b8
                    except Exception as exc:  # noqa: BLE001
                        self.fail([r], exc)
            # casts of each GEMM's inputs
            for what, src in (("x", X), ("dy", DY), ("w", W.reshape(-1, g.k))):
                for r in self.find(case=c.name, part="c", role=f"{g.name}.{what}"):
                    self.log(f"  c {r['impl']} {r['role']} {r['shape']}")
                    try:
                        fn = self._cast_fn(r["impl"], src)
                    except Exception as exc:  # noqa: BLE001
                        self.fail([r], exc)
                        continue
                    self.burst(r, fn)
        del t
        if self.cuda:
            torch.cuda.empty_cache()

    def _scaled(self, r: dict, candidates, scales, fast: bool = False) -> None:
        torch = self.torch
        last: BaseException | None = None
        for (a, b), label in candidates:
            sa, sb = scales(a, b)
            for acc in (True, False) if fast else (False,):

                def fn(a=a, b=b, sa=sa, sb=sb, acc=acc):
                    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=acc)

                try:
                    fn()
                except Exception as exc:  # noqa: BLE001
                    last = exc
                    continue
                r["fp8_formats"] = label + (", fast accumulation" if acc else "")
                self.burst(r, fn)
                return
        self.fail([r], last or RuntimeError("no operand layout ran"))

    def _blockwise(self, r: dict, candidates, role: str) -> None:
        """1x128 activations / gradients, 128x128 weights (TE Float8BlockScaling; wgrad 1x128 both),
        trying the scale layouts torch builds have asked for (first that runs)."""
        torch, dev = self.torch, self.device
        last: BaseException | None = None
        for (a, b), label in candidates:
            M, K = a.shape
            N = b.shape[1]
            if K % 128 or (role != "wgrad" and N % 128):
                last = ValueError(f"block scales need K (and N for 128x128) % 128 == 0, got N={N} K={K}")
                continue
            sa0 = torch.ones(M, K // 128, device=dev, dtype=torch.float32)
            sb0 = torch.ones(K // 128, N if role == "wgrad" else N // 128, device=dev, dtype=torch.float32)
            # torch's own tests (test_matmul_cuda.py, blockwise): 1x128 scales of a [M, K/128] M-major,
            # 128x128 scales of b [K/128, N/128] K-major, 1x128 scales of b [K/128, N] row-major; those
            # layouts first, then the others
            sb_col = sb0.t().contiguous().t()
            for sa in (sa0.t().contiguous().t(), sa0):
                for sb in (sb0, sb_col) if role == "wgrad" else (sb_col, sb0):

                    def fn(a=a, b=b, sa=sa, sb=sb):
                        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001
                        last = exc
                        continue
                    r["fp8_formats"] = label
                    r["scale_layout"] = (
                        f"scale_a strides {tuple(sa.stride())}, scale_b strides {tuple(sb.stride())}"
                    )
                    self.burst(r, fn)
                    return
        self.fail([r], last or RuntimeError("no scale layout ran"))

    def _cast_fn(self, impl: str, src):
        torch = self.torch
        e4 = torch.float8_e4m3fn
        if impl == "cast_plain":
            return lambda: src.to(e4)
        if impl == "cast_tensor":

            def per_tensor():
                scale = FP8_MAX / src.abs().amax().float().clamp(min=1e-12)
                return (src * scale.to(src.dtype)).to(e4), scale.reciprocal()

            return per_tensor
        if impl == "cast_block":
            rows_, cols = src.shape
            if cols % 128:
                raise ValueError(f"1x128 blocks need cols % 128 == 0, got {cols}")
            v = src.view(rows_, cols // 128, 128)

            def per_block():
                amax = v.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
                scale = FP8_MAX / amax
                return (v * scale.to(v.dtype)).to(e4), scale.reciprocal()

            return per_block
        raise ValueError(impl)
