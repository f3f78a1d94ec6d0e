# The probe that produced run2-probe-nosaves.txt (run from the repo root on the H200 with the session's wheel):
# ResNet-50 batch 64 under four Monitor settings, 3 rounds x 10 steps after 3 warm-up steps, then cProfile of
# 10 steps with activations=None, breakdown_every=1.
import cProfile, pstats, time
import torch, torchvision, torchmem
dev = torch.device("cuda")
model = torchvision.models.resnet50().to(dev)
x = torch.randn(64, 3, 224, 224, device=dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def step(mon):
    with mon.step():
        model(x).float().logsumexp(1).mean().backward(); opt.step(); opt.zero_grad(set_to_none=True)
kinds = {"monitor": dict(breakdown=False), "every": dict(breakdown_every=1), "nosaves": dict(activations=None, breakdown_every=1), "nosaves_sampled": dict(activations=None)}
for rnd in range(3):
    for k, kw in kinds.items():
        mon = torchmem.Monitor(model, opt, verbose=False, warn=False, **kw)
        for _ in range(3): step(mon)
        torch.cuda.synchronize(); t0 = time.perf_counter(); c0 = time.process_time()
        for _ in range(10): step(mon)
        torch.cuda.synchronize()
        print(rnd, k, f"{(time.perf_counter()-t0)/10*1e3:.2f} ms/step wall, {(time.process_time()-c0)/10*1e3:.2f} CPU", flush=True)
        mon.close()
mon = torchmem.Monitor(model, opt, verbose=False, warn=False, activations=None, breakdown_every=1)
for _ in range(3): step(mon)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(10): step(mon)
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
mon.close()
