// is_causal for the standalone harnesses, whichever params struct they build
// against: a commit's src/params.h with an is_causal field, or one whose mask
// mode carries the band (MaskArgs: mode kBand, window_right 0).
#pragma once

template <class P>
auto set_causal(P& p, bool causal, int) -> decltype(p.is_causal = causal, void()) {
  p.is_causal = causal;
}
template <class P>
void set_causal(P& p, bool causal, long) {
  if (causal) {
    p.mask.mode = decltype(p.mask.mode)(1);  // MaskMode::kBand
    p.mask.window_right = 0;
  }
}
template <class P>
void set_causal(P& p, bool causal) {
  set_causal(p, causal, 0);
}
