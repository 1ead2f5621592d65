// c10d's Gloo process group where LibTorch ships Gloo's headers (Debian's does; PyTorch's wheels do
// not), as `moerl bench ep` detects it: MOERL_HAVE_GLOO is defined then.
#pragma once

#if __has_include(<gloo/algorithm.h>)
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define MOERL_HAVE_GLOO 1

#include <string>

namespace moerl::rl::detail {

// Rank `rank` of `world` meeting the others through `store`. The address it binds: 127.0.0.1 when
// `addr` (where the others are: the rendezvous store's host) is a loopback address, the interface
// GLOO_SOCKET_IFNAME names when that is set, else the hostname's.
c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                           int rank, int world, const std::string& addr,
                                                           double timeout_s);

}  // namespace moerl::rl::detail
#endif
