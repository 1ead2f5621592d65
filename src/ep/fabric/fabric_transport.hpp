// Internal: provider selection of the fabric transport, shared by the transport and its tests
// (the factory itself is declared in builtin.hpp).
#pragma once

#include <string>

#include "fabric/fi_check.hpp"
#include "moerl/ep/transport.hpp"

namespace moerl::ep {

namespace fabric {

// What the transport asks every provider for.
constexpr uint64_t kMrModes =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_RAW;

// The first fi_info of `provider` (matched by prefix: "tcp" accepts "tcp;ofi_rxm") with an FI_EP_RDM
// endpoint, RMA writes and at least 4 bytes of remote CQ data, in `domain` (a NIC, by name) unless it is
// empty; for a region outside plain host memory also FI_HMEM (and FI_MR_HMEM registration). Throws
// moerl::Error explaining why none fits.
Info select_info(const std::string& provider, const std::string& domain,
                 RegionMemory memory = RegionMemory::kHost);

}  // namespace fabric

// True when select_info finds a match; otherwise false, with the reason in *why when why is not null.
bool fabric_provider_available(const std::string& provider, std::string* why = nullptr,
                               RegionMemory memory = RegionMemory::kHost);

}  // namespace moerl::ep
