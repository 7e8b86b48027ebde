import sys, time, os
sys.path.insert(0, "/work/main/tests/runtime")
from dist_util import run_dist
def worker(rank, world, t0):
    return time.time() - t0
if __name__ == "__main__":
    fails = 0
    for i in range(6):
        for w in [2, 4]:
            t = time.time()
            try:
                r = run_dist(worker, w, t); print(w, round(time.time() - t, 2), [round(x,2) for x in r])
            except AssertionError as e:
                fails += 1; print("FAIL", str(e)[-3000:])
    print("fails", fails)
