"""memory_budget on the GPU (tag gpu): a Llama-1B-shaped LoRA model at seq 4096 under a cap
that fits some layers resident and not all, with the model's loss and with Liger's fused
one (skipped without liger_kernel: tools/gpu_peers.sh). The plan mixes the modes (resident
layers, and selective ones keeping op outputs where those save more per byte), the step's
reserved peak stays under the cap and within the plan's prediction, the plan runs with the
allocator held to its predicted reserved peak, and losses and gradients are bit-identical
to full checkpointing (eager attention: deterministic kernels). With Llama
3's vocabulary, a budget of the checkpointed step's own peak and room for the outputs in
transit offloads op outputs through the engine, bit-identically, at the memory
ckpt_offload uses without a budget and that room. Neither a layer's recompute time, nor
the measured step's time or peak, counts the meter's own work. Planned steps are timed by
CUDA events (forward and backward, not the work between steps), and a real out-of-memory
error under a plan makes later plans keep less.

    python -m pytest -s tests/gpu/budget_gpu_test.py
"""

import dataclasses
import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SEQ, STEPS, LAYERS = 4096, 6, 16
GIB = 2**30


def lora_llama(vocab=32000, loss="model"):
    """`loss`: "model" (the model's own) or "liger" (Liger-Kernel's patch with its defaults:
    fused linear cross-entropy, RMSNorm, SwiGLU, RoPE)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=LAYERS,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=vocab,
        max_position_embeddings=SEQ, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if loss == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))


def run(model, handle=None, empty_cache=False):
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    losses, grads, reserved, plans = [], [], [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        if empty_cache:  # each step's reserved peak its own
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.max_memory_reserved())
        # Kept on the host: copies held on the device would raise every later step's peak.
        losses.append(loss.detach().cpu())
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters()
                      if p.grad is not None})
        model.zero_grad(set_to_none=True)
        if handle is not None:
            plans.append(dict(handle.budget_stats(),
                              allocated_peak_bytes=torch.cuda.max_memory_allocated()))
    return losses, grads, reserved, plans


def largest_difference(grads_a, grads_b) -> float:
    return max((a[name].float() - b[name].float()).abs().max().item()
               for a, b in zip(grads_a, grads_b) for name in a)


@pytest.mark.parametrize("loss", ["model", "liger"])
def test_a_plan_at_a_cap_fits_and_is_bit_identical(loss, llama_module_restored):
    """With the model's loss and with Liger's fused one, which peaks in the layers' backward
    rather than the head (the plan counts its resident layers there). Where Liger's kernels
    do not repeat bit for bit from run to run, the plan's gradients stay within that."""
    from ckpt_offload.budget import plan_layers
    from ckpt_offload.hf import enable_activation_offload

    if loss == "liger":
        pytest.importorskip("liger_kernel")
    expected_losses, expected_grads, _, _ = run(lora_llama(loss=loss))
    gc.collect()
    torch.cuda.empty_cache()
    repeats, spread = True, 0.0
    if loss == "liger":
        again_losses, again_grads, _, _ = run(lora_llama(loss=loss))
        spread = largest_difference(expected_grads, again_grads)
        repeats = spread == 0 and all(torch.equal(a, b)
                                      for a, b in zip(again_losses, expected_losses))
        print(f"liger: run-to-run gradient difference {spread}")
        gc.collect()
        torch.cuda.empty_cache()

    # Probe: the step's allocated peak with every layer checkpointed, and one layer's bytes.
    model = lora_llama(loss=loss)
    handle = enable_activation_offload(model, memory_budget="1TiB")
    run(model, handle)
    measured = handle._budget.measurement
    layer_bytes = max(c.saved_bytes_per_token for c in measured.layers) * measured.tokens
    handle.disable()
    del model, handle
    gc.collect()
    torch.cuda.empty_cache()

    # A cap with room for about 5 resident layers beside the checkpointed step's peak.
    cap = (measured.peak_bytes + 5.5 * layer_bytes) / 0.95 + GIB
    model, handle, (losses, grads, reserved, plans) = planned_run(loss, "auto", cap)
    modes = handle.layer_modes()
    planned = handle._budget.latest_plan
    resident, selective = modes.count("resident"), modes.count("selective")
    if loss == "liger":
        # The step peaks in the layers' backward; counting each kept byte on top of the
        # whole step's peak, with the full margin, would save less.
        measured = handle._budget.measurement
        assert measured.head_phase_peak_bytes < measured.layer_phase_peak_bytes
        blind = plan_layers(dataclasses.replace(
            measured, layer_phase_peak_bytes=0, head_phase_peak_bytes=0, head_rise_bytes=0,
            forward_peak_bytes=0, head_peak_bytes=0), planned.tokens, planned.budget_bytes)
        print(f"liger: {resident} resident, {planned.predicted_seconds_saved * 1e3:.1f} ms "
              f"saved, where counting every kept byte on top of the step's peak would keep "
              f"{blind.count('resident')}, {blind.predicted_seconds_saved * 1e3:.1f} ms")
        assert planned.predicted_seconds_saved > blind.predicted_seconds_saved
    print(f"{loss}: cap {cap / GIB:.2f} GiB, layer {layer_bytes / GIB:.3f} GiB, plan {resident} "
          f"resident / {selective} selective / {modes.count('checkpoint')} checkpointed, "
          f"reserved peaks {[round(r / GIB, 2) for r in reserved]}, predicted "
          f"{plans[-1]['budget_predicted_peak_bytes'] / GIB:.2f} GiB")
    assert resident < LAYERS and resident + selective > 0
    assert modes[LAYERS - resident:] == ["resident"] * resident
    assert "resident" not in modes[:LAYERS - resident]
    assert max(reserved) <= cap
    assert max(reserved[2:]) <= plans[-1]["budget_predicted_peak_bytes"] + GIB
    # Allocations: within 0.5 GiB of the prediction (the planner's target).
    allocated = max(p["allocated_peak_bytes"] for p in plans[2:])
    predicted = plans[-1]["budget_predicted_allocated_bytes"]
    print(f"{loss}: allocated peaks "
          f"{[round(p['allocated_peak_bytes'] / GIB, 2) for p in plans]} GiB, predicted "
          f"{predicted / GIB:.2f}")
    assert abs(allocated - predicted) <= GIB / 2
    check_same(expected_losses, expected_grads, losses, grads, repeats, spread)

    # The predicted reserved peak as both budget and cap: the allocator may reserve no more
    # than the plan said. Above its allocations it caches free blocks (eager attention's
    # float32 probabilities' among them), which it gives back when held there; the pieces
    # it cannot give back must be within the plan's margins.
    held = int(plans[-1]["budget_predicted_peak_bytes"])
    handle.disable()
    del model, handle
    gc.collect()
    torch.cuda.empty_cache()
    model, handle, (losses, grads, reserved, plans) = planned_run(loss, held, held)
    print(f"{loss}: held at {held / GIB:.2f} GiB: plan {handle.layer_modes().count('resident')} "
          f"resident, reserved peaks {[round(r / GIB, 2) for r in reserved]}, allocated peaks "
          f"{[round(p['allocated_peak_bytes'] / GIB, 2) for p in plans]} GiB")
    # The allocator, held to `held`, raises rather than reserve more: running is the check.
    assert "resident" in handle.layer_modes()  # a plan that still keeps layers, no room left
    assert plans[-1]["budget_predicted_peak_bytes"] <= held
    check_same(expected_losses, expected_grads, losses, grads, repeats, spread)
    handle.disable()


def planned_run(loss, budget, cap):
    """run() of a fresh model under memory_budget=`budget`, the allocator held to `cap`
    bytes: (model, handle, run()'s figures)."""
    from ckpt_offload.hf import enable_activation_offload

    torch.cuda.set_per_process_memory_fraction(
        cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        model = lora_llama(loss=loss)
        handle = enable_activation_offload(model, memory_budget=budget)
        return model, handle, run(model, handle)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def check_same(expected_losses, expected_grads, losses, grads, repeats, spread):
    """Losses and gradients bit-identical to the expected ones, or where the loss's own
    kernels do not repeat (`repeats`), gradients within twice their run-to-run `spread`."""
    if not repeats:
        assert largest_difference(expected_grads, grads) <= 2 * spread
        return
    for step in range(STEPS):
        assert torch.equal(losses[step], expected_losses[step]), step
        for name, grad in expected_grads[step].items():
            assert torch.equal(grads[step][name], grad), (step, name)


def test_a_budget_of_todays_memory_offloads_outputs_bit_identically():
    from ckpt_offload.hf import enable_activation_offload

    vocab = 128256
    expected_losses, expected_grads, _, _ = run(lora_llama(vocab))
    gc.collect()
    torch.cuda.empty_cache()

    model = lora_llama(vocab)
    handle = enable_activation_offload(model)
    _, _, today, _ = run(model, handle, empty_cache=True)
    measured = handle._budget.measurement  # measured without a budget too (for advice)
    handle.disable()
    del model, handle
    gc.collect()
    torch.cuda.empty_cache()

    # Today's memory and room for the outputs in transit: the smallest such budget whose
    # plan offloads (here the layers' backward, eager attention's scores, is the peak).
    from ckpt_offload.budget import OutputOffload, plan_layers
    from ckpt_offload.config import OffloadConfig
    from ckpt_offload.copy_rate import host_copy_bytes_per_second
    rate = host_copy_bytes_per_second()  # what the budget plans with on this device
    assert 1e9 < rate < 1e12 and host_copy_bytes_per_second() == rate  # measured once
    config = OffloadConfig()
    offload = OutputOffload.for_engine(rate, config.keep_last, config.prefetch_depth,
                                       config.max_inflight_d2h_groups, config.min_offload_bytes)
    budget = measured.peak_bytes
    while plan_layers(measured, measured.tokens, budget, 0, offload).offloading_layers == 0:
        budget += GIB // 8
        assert budget < measured.peak_bytes + 4 * GIB, "no plan offloads"
    budget += GIB // 4  # the planned run measures its own step: times vary a little

    model = lora_llama(vocab)
    handle = enable_activation_offload(model, memory_budget=budget)
    losses, grads, reserved, plans = run(model, handle, empty_cache=True)
    stats = handle.stats()
    plan = plans[-1]
    print(f"today's reserved peak {max(today[2:]) / GIB:.2f} GiB; budget "
          f"{budget / GIB:.2f} GiB, measured peak {measured.peak_bytes / GIB:.2f} (layer phase "
          f"{measured.layer_phase_peak_bytes / GIB:.2f}): {plan['budget_offloading_layers']} "
          f"layers offload {plan['budget_offloaded_output_bytes'] / GIB:.2f} GiB of outputs "
          f"(copies {rate / 1e9:.1f} GB/s), "
          f"predicted to save {plan['budget_predicted_saved_ms']:.1f} ms; reserved peaks "
          f"{[round(r / GIB, 2) for r in reserved]}; exposed wait "
          f"{stats['exposed_wait_ms']:.2f} ms")
    assert 0 < plan["budget_offloading_layers"] <= LAYERS - 3  # the last ones never do
    assert plan["budget_copy_bytes_per_second"] == rate
    assert max(reserved[2:]) <= max(today[2:]) + (budget - measured.peak_bytes) + GIB // 2
    for step in range(STEPS):
        assert torch.equal(losses[step], expected_losses[step]), step
        for name, grad in expected_grads[step].items():
            assert torch.equal(grads[step][name], grad), (step, name)
    handle.disable()


def test_a_layers_recompute_time_leaves_out_the_meters_own_work(monkeypatch):
    """The meter's host work between ops leaves the device idle, which the recompute's
    events would count: slowed down to 2 ms per op, it must not reach the plan's figures."""
    import time

    from ckpt_offload.hf import enable_activation_offload
    from ckpt_offload.hf import layer_budget

    delay = 2e-3
    metered_ops = []
    after = layer_budget._OutputMeter._after

    def slow_after(meter, *args):
        metered_ops.append(None)
        time.sleep(delay)
        return after(meter, *args)

    monkeypatch.setattr(layer_budget._OutputMeter, "_after", slow_after)
    model = lora_llama()
    handle = enable_activation_offload(model, memory_budget="1TiB")
    run(model, handle)
    measured = handle._budget.measurement
    handle.disable()
    ops_per_layer = len(metered_ops) / LAYERS
    slowest = max(c.recompute_seconds_per_token for c in measured.layers) * measured.tokens
    print(f"{ops_per_layer:.0f} metered ops per layer, {delay * 1e3:.0f} ms each added; "
          f"the slowest layer's recompute planned at {slowest * 1e3:.2f} ms")
    assert ops_per_layer >= 20
    assert all(c.outputs for c in measured.layers)  # every layer was metered
    assert slowest < ops_per_layer * delay / 2
    # Nor does the measured step's time, which the plans' predicted step times start from.
    print(f"measured step {measured.step_seconds * 1e3:.1f} ms, meter delays "
          f"{len(metered_ops) * delay * 1e3:.0f} ms")
    assert 0 < measured.step_seconds < len(metered_ops) * delay / 2


def test_step_times_are_the_devices_forward_and_backward():
    """stats() times each planned step from its forward's start to its backward's end with
    CUDA events, read without waiting: near the step's synchronized wall time, without the
    device work that runs between steps (an optimizer's, a generation's)."""
    import statistics
    import time

    from ckpt_offload.hf import enable_activation_offload

    model = lora_llama()
    handle = enable_activation_offload(model, memory_budget="1TiB")
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ),
                        generator=torch.Generator().manual_seed(0)).cuda()
    busy, product = (torch.ones(8192, 8192, device="cuda", dtype=torch.bfloat16)
                     for _ in range(2))
    walls, between = [], []
    for _ in range(8):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for _ in range(100):
            torch.mm(busy, busy, out=product)
        torch.cuda.synchronize()
        between.append(time.perf_counter() - start)
    stats = handle.stats()
    wall = statistics.median(walls[2:]) * 1e3
    print(f"planned steps: {wall:.1f} ms synchronized, {stats['budget_measured_step_ms']:.1f} "
          f"ms timed (median of {stats['budget_measured_steps']}), predicted "
          f"{stats['budget_predicted_step_ms']:.1f} ms, checkpointed "
          f"{stats['budget_checkpointed_step_ms']:.1f} ms; {statistics.median(between) * 1e3:.1f} "
          f"ms of device work between steps")
    handle.disable()
    assert stats["budget_resident_layers"] == LAYERS
    assert stats["budget_measured_steps"] >= 4
    assert 0.8 * wall < stats["budget_measured_step_ms"] <= 1.02 * wall
    assert 0 < stats["budget_predicted_step_ms"] < stats["budget_checkpointed_step_ms"]


def test_the_measured_step_peaks_where_an_unmeasured_one_does():
    """The meter's own work (op timing, content checks) adds nothing to the measured step's
    peak, above which a plan counts what it keeps: the same as a step of ckpt_offload
    without a budget. The largest output the checks read is eager attention's
    probabilities (1 GiB a layer here)."""
    from ckpt_offload.hf import enable_activation_offload

    plain = lora_llama()
    plain_handle = enable_activation_offload(plain)
    run(plain)
    breakdown = plain_handle.peak_breakdown()
    plain_handle.disable()
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    model = lora_llama()
    handle = enable_activation_offload(model, memory_budget="1TiB")
    run(model, handle)
    measured = handle._budget.measurement
    handle.disable()
    assert breakdown is not None and measured is not None
    difference = measured.activation_peak_bytes - breakdown["step_peak_bytes"]
    print(f"activation peak: measured step {measured.activation_peak_bytes / GIB:.3f} GiB, "
          f"ckpt_offload's {breakdown['step_peak_bytes'] / GIB:.3f} GiB")
    assert abs(difference) <= 64 * 2**20


def test_running_out_of_memory_under_a_plan_backs_off():
    """A real out-of-memory error in a planned step (a forward hook asks for more than the
    device has): the allocator's observer tells the budget, which halves what later plans
    keep above the checkpointed step, and training goes on."""
    from ckpt_offload.hf import enable_activation_offload

    model = lora_llama()
    handle = enable_activation_offload(model, memory_budget="auto")
    ids = torch.randint(0, model.config.vocab_size, (1, SEQ),
                        generator=torch.Generator().manual_seed(0)).cuda()
    too_much = 2 * torch.cuda.get_device_properties(0).total_memory
    failing = {"step": False}

    def ask_too_much(module, args, output):
        if failing["step"] and torch.is_grad_enabled():
            torch.empty(too_much, dtype=torch.uint8, device="cuda")

    hook = model.base_model.model.model.norm.register_forward_hook(ask_too_much)
    failed, before = [], None
    for step in range(1, 7):
        failing["step"] = step == 4
        try:
            model(input_ids=ids, labels=ids).loss.backward()
        except torch.OutOfMemoryError:
            failed.append(step)
        model.zero_grad(set_to_none=True)
        if step == 3:
            before = handle.stats()
    after = handle.stats()
    hook.remove()
    handle.disable()
    print(f"budget {before['budget_bytes'] / GIB:.2f} GiB, {before['budget_resident_layers']} "
          f"resident; after the error {after['budget_bytes'] / GIB:.2f} GiB, "
          f"{after['budget_resident_layers']} resident")
    assert failed == [4]
    assert before["budget_kept_share"] == 1.0 and after["budget_kept_share"] == 0.5
    assert after["budget_bytes"] < before["budget_bytes"]
