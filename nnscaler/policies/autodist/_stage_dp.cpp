// cppimport
// The pipeline stage DP (see nnscaler/policies/stage_dp.py, whose pure-Python stage_dp_py is the
// reference: same loops, same order, same double arithmetic, so both return identical plans).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <utility>
#include <vector>

namespace py = pybind11;

static std::pair<double, std::vector<int>> stage_dp(const std::vector<double>& seg_time,
                                                    const std::vector<double>& seg_act,
                                                    const std::vector<double>& seg_param, int nstages,
                                                    int nmicros, double mem_limit,
                                                    const std::vector<double>& seg_cross,
                                                    const std::vector<int>& seg_need) {
    const double inf = std::numeric_limits<double>::infinity();
    const double tie = 1e-9;  // stage_dp.TIE
    const int L = static_cast<int>(seg_time.size());
    if (nstages < 1 || nstages > L) return {inf, {}};
    std::vector<double> pt(L + 1, 0.0), pa(L + 1, 0.0), pp(L + 1, 0.0);
    std::vector<int> pn(L + 1, 0);
    for (int i = 0; i < L; ++i) {
        pt[i + 1] = pt[i] + seg_time[i];
        pa[i + 1] = pa[i] + seg_act[i];
        pp[i + 1] = pp[i] + seg_param[i];
        pn[i + 1] = pn[i] + ((seg_need.empty() || seg_need[i]) ? 1 : 0);
    }
    // best[s][j]: least slowest-stage time covering segments [0, j) with s stages; square[s][j]: the
    // least sum of squared stage times among splits that slow (the tie-break)
    std::vector<std::vector<double>> best(nstages + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<double>> square(nstages + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> cut(nstages + 1, std::vector<int>(L + 1, -1));
    best[0][0] = 0.0;
    square[0][0] = 0.0;
    for (int s = 1; s <= nstages; ++s) {
        const int stage = s - 1;
        const int inflight = (nstages - stage) < nmicros ? (nstages - stage) : nmicros;
        for (int j = s; j <= L - (nstages - s); ++j) {
            for (int i = s - 1; i < j; ++i) {
                if (best[s - 1][i] == inf || pn[j] - pn[i] == 0) continue;
                const double mem = (pp[j] - pp[i]) + (pa[j] - pa[i]) * inflight;
                if (mem > mem_limit) continue;
                double t = pt[j] - pt[i];
                if (i > 0 && !seg_cross.empty()) t += seg_cross[i];
                if (j < L && !seg_cross.empty()) t += seg_cross[j];
                const double v = best[s - 1][i] > t ? best[s - 1][i] : t;
                const double sq = square[s - 1][i] + t * t;
                if (v < best[s][j] * (1.0 - tie) || (v <= best[s][j] * (1.0 + tie) && sq < square[s][j])) {
                    best[s][j] = v;
                    square[s][j] = sq;
                    cut[s][j] = i;
                }
            }
        }
    }
    if (best[nstages][L] == inf) return {inf, {}};
    std::vector<int> starts(nstages, 0);
    int j = L;
    for (int s = nstages; s >= 1; --s) {
        const int i = cut[s][j];
        starts[s - 1] = i;
        j = i;
    }
    return {best[nstages][L], starts};
}

PYBIND11_MODULE(_stage_dp, m) {
    m.doc() = "Pipeline stage boundaries by dynamic programming (the hot loop of the pipeline search).";
    m.def("stage_dp", &stage_dp, py::arg("seg_time"), py::arg("seg_act"), py::arg("seg_param"),
          py::arg("nstages"), py::arg("nmicros"), py::arg("mem_limit"),
          py::arg("seg_cross") = std::vector<double>(), py::arg("seg_need") = std::vector<int>());
}
/*
<%
setup_pybind11(cfg)
cfg['extra_compile_args'] = ['-O2', '-std=c++17']
%>
*/
