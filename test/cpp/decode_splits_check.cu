// Checks the decode family's split rule (src/decode/launch.h splits_for,
// workspace_bytes) over a grid of calls the family accepts: every key in
// exactly one non-empty split of whole tiles, at most kMaxSplits, never a
// second wave of CTAs where one wave holds the call, half the CTA slots at
// most for a single unmasked query token, masked splits no longer than the
// tile list holds, and a workspace exactly the partials' size. Host code;
// run by test/test_decode_splits.py, which reads the last line ("ok" or the
// failures).
#include <cstdio>

#include "decode/launch.h"

namespace {

int failures = 0, calls = 0;

void fail(const tfb::AttnFwdParams& p, const char* what) {
  if (++failures <= 10) {
    std::printf("FAIL %s: sms %d E %d B %d Hq %d Hkv %d L %d S %d mode %d\n", what, p.num_sms, p.head_dim, p.batch,
                p.heads_q, p.heads_kv, p.len_q, p.len_k, int(p.mask.mode));
  }
}

void check(const tfb::AttnFwdParams& p) {
  using namespace tfb::decode;
  if (!fits(p)) return;
  ++calls;
  const Splits s = splits_for(p);
  const int keys = tfb::mask::band_of(p.mask, p.len_q, p.len_k).key_end(p.len_q - 1);
  const int64_t ctas = int64_t(p.batch) * p.heads_kv * Rows{rows_per_kv_head(p), 1}.tiles();
  const int64_t slots = int64_t(p.num_sms) * ctas_per_sm(p.head_dim, masked(p));
  if (s.count < 1 || s.count > kMaxSplits) fail(p, "split count out of [1, kMaxSplits]");
  if (s.chunk <= 0 || s.chunk % kTileKeys != 0) fail(p, "a split is not whole tiles");
  if (int64_t(s.count - 1) * s.chunk >= keys || int64_t(s.count) * s.chunk < keys) fail(p, "keys not covered once");
  if (s.count > (keys + kMinSplitKeys - 1) / kMinSplitKeys && s.count > 1) fail(p, "more splits than the floor allows");
  if (masked(p) && s.chunk > kMaxMaskedSplitKeys) fail(p, "a masked split longer than its tile list");
  if (!masked(p) && ctas <= slots && s.count * ctas > slots) fail(p, "a second wave of CTAs");
  if (single_token(p) && s.count > 1 && s.count * ctas > slots / 2) fail(p, "a single token past half the slots");
  const size_t partials = size_t(s.count) * p.batch * p.heads_q * p.len_q * (p.head_dim + 1) * sizeof(float);
  if (workspace_bytes(p) != (s.count == 1 ? 0 : partials)) fail(p, "workspace size");
}

}  // namespace

int main() {
  static uint8_t mask_byte = 1;
  for (int sms : {108, 132}) {
    for (int e : {32, 64, 96, 128, 192, 256}) {
      for (int b : {1, 2, 8, 64, 512}) {
        for (int hkv : {1, 4, 8, 32}) {
          for (int group : {1, 4, 8}) {
            for (int len_q : {1, 4, 16}) {
              for (int len_k : {1, 15, 16, 17, 129, 1000, 1024, 4096, 65536, 1 << 20}) {
                for (int mode = 0; mode < 3; ++mode) {  // none, causal (bottom-right), boolean mask
                  tfb::AttnFwdParams p{};
                  p.num_sms = sms;
                  p.head_dim = p.qk_dim = p.v_dim = e;
                  p.batch = b;
                  p.heads_kv = hkv;
                  p.heads_q = hkv * group;
                  p.len_q = len_q;
                  p.len_k = len_k;
                  if (mode == 1) {
                    p.mask.mode = tfb::MaskMode::kBand;
                    p.mask.window_right = 0;
                    p.mask.bottom_right = true;
                  } else if (mode == 2) {
                    p.mask.mode = tfb::MaskMode::kBool;
                    p.mask.values = &mask_byte;
                  }
                  check(p);
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("%d calls\n", calls);
  std::printf(failures ? "%d failures\n" : "ok\n", failures);
  return failures ? 1 : 0;
}
