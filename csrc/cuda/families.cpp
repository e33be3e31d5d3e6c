#include "families.h"

#include <algorithm>
#include <cstdlib>

#include <c10/util/Exception.h>

#include "api.h"

namespace tfb {
namespace {

constexpr const char* kFamiliesEnv = "TFB_KERNEL_FAMILIES";

std::string_view trim(std::string_view s) {
  const size_t first = s.find_first_not_of(" \t");
  return first == std::string_view::npos ? std::string_view() : s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

// Every pass falls back on sm80; the error names the switch that took it away.
void check_sm80(bool built, const char* pass, const at::Tensor& q, const AttnShape& s) {
  TORCH_CHECK(family_allowed("sm80"), kFamiliesEnv, "=\"", std::getenv(kFamiliesEnv),
              "\" excludes sm80, the only kernel family that can run this ", pass, " (head_dim=", s.head_dim,
              ", dtype ", q.scalar_type(), ", ", q.device(), ")");
  TORCH_CHECK(built, "no sm80 ", pass, " kernel was built for head_dim=", s.head_dim, " and dtype ", q.scalar_type());
}

}  // namespace

bool family_allowed(std::string_view family) {
  const char* env = std::getenv(kFamiliesEnv);
  std::string_view rest = env == nullptr ? "" : env;
  bool names_any = false;
  while (!rest.empty()) {
    const size_t end = std::min(rest.find(','), rest.size());
    const std::string_view name = trim(rest.substr(0, end));
    rest.remove_prefix(std::min(end + 1, rest.size()));
    if (name == family) return true;
    names_any = names_any || !name.empty();
  }
  return !names_any;
}

Family forward_family(const DeviceInfo& info, DType dtype, const AttnFwdParams& p, const at::Tensor& q,
                      const AttnShape& s) {
  // sm_90a code runs on compute capability 9.0 alone, not on later chips.
  if (info.major == 9 && info.minor == 0 && family_allowed("sm90") && sm90::has_fwd(dtype, p.head_dim) &&
      sm90::can_run_fwd(p)) {
    return Family::kSm90;
  }
  check_sm80(sm80::has_fwd(dtype, p.head_dim), "forward", q, s);
  return Family::kSm80;
}

void check_backward(DType dtype, const at::Tensor& q, const AttnShape& s) {
  check_sm80(sm80::has_bwd(dtype, s.head_dim), "backward", q, s);
}

}  // namespace tfb
