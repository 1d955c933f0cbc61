import sys, torch
from tests.storage.test_manager import _manager, _put
def test_race(kv_metadata, make_chunk, tmp_path, cache_server):
    sys.setswitchinterval(1e-6)
    try:
        m = _manager(kv_metadata, disk=tmp_path, remote=cache_server.url, local_cpu=False, timeout=30)
        exp = {}
        for s in range(300):
            k, e = _put(m, make_chunk, s); exp[k] = e
        m.flush(timeout=30)
        bad = 0
        for k, e in exp.items():
            for t in m.tiers:
                o = t.get(k, m.cpu.allocate)
                if o is not None and not torch.equal(o.tensor.view(torch.uint8), e.view(torch.uint8)): bad += 1
                if o is not None: o.free()
        m.close()
        print("STATS", m.usage()); assert bad == 0, bad
    finally:
        sys.setswitchinterval(0.005)
