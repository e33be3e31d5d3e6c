// Numbers more than one layer uses, each stated once. The Python package reads
// them from the library (the constants() op), never restates them; the
// additive mask's limits live beside their rule in mask_values.h.
#pragma once

namespace tfb {

// log2(e): the kernels exponentiate with exp2, so the softmax scale reaches
// them in log2 units (AttnFwdParams::scale_log2) and a natural-log logsumexp
// converts with it.
constexpr double kLog2e = 1.4426950408889634;
constexpr float kLog2eFloat = static_cast<float>(kLog2e);
// ln(2), its inverse, for the way back.
constexpr float kLn2Float = static_cast<float>(1.0 / kLog2e);

}  // namespace tfb
