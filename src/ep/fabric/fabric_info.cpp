// Provider selection for the fabric transport: one set of hints that every supported provider (tcp,
// shm, efa, verbs) can answer, so that changing provider is a change of name only; FI_HMEM on top
// for a region in device memory.
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include <cstring>

#include "fabric/fabric_transport.hpp"
#include "moerl/core/error.hpp"

namespace moerl::ep {

namespace fabric {

namespace {

bool provider_matches(const char* prov_name, const std::string& wanted) {
    // "tcp" must accept the layered "tcp;ofi_rxm" that libfabric returns for RDM over tcp.
    if (prov_name == nullptr) return false;
    const std::string name(prov_name);
    return name.compare(0, wanted.size(), wanted) == 0 &&
           (name.size() == wanted.size() || name[wanted.size()] == ';');
}

}  // namespace

Info select_info(const std::string& provider, const std::string& domain, RegionMemory memory) {
    MOERL_CHECK(!provider.empty(),
                "fabric transport: fabric_provider is empty (expected e.g. tcp, shm, efa, verbs)");
    Info hints(fi_allocinfo());
    MOERL_CHECK(hints != nullptr, "libfabric: fi_allocinfo failed");
    // FI_MSG|FI_RECV only so that receives can be posted when the provider needs FI_RX_CQ_DATA.
    hints->caps = FI_MSG | FI_RECV | FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    // Modes the transport honours; the provider clears those it does not need.
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = static_cast<int>(kMrModes);
    const bool hmem = memory != RegionMemory::kHost;
    if (hmem) {
        // Device memory registered with the NIC; FI_MR_HMEM: the provider may require it be registered.
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
    }
    // All calls into the domain are serialised by the transport's mutex.
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(provider.c_str());  // fi_freeinfo frees it
    if (!domain.empty()) hints->domain_attr->name = strdup(domain.c_str());

    fi_info* list = nullptr;
    const int rc =
        fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), nullptr, nullptr, 0, hints.get(), &list);
    Info owned(list);
    MOERL_CHECK(rc == 0 || rc == -FI_ENODATA, "libfabric: fi_getinfo for provider '", provider, "'",
                domain.empty() ? "" : " in domain '" + domain + "'", " failed: ", fi_strerror(-rc), " (", rc,
                ")");
    std::string rejected;
    for (fi_info* info = list; info != nullptr; info = info->next) {
        if (!provider_matches(info->fabric_attr->prov_name, provider)) {
            rejected += detail::concat(" ", info->fabric_attr->prov_name, " (other provider);");
            continue;
        }
        if (info->domain_attr->cq_data_size < 4) {
            rejected += detail::concat(" ", info->fabric_attr->prov_name, " (",
                                       info->domain_attr->cq_data_size, " bytes of remote CQ data, need 4);");
            continue;
        }
        Info chosen(fi_dupinfo(info));
        MOERL_CHECK(chosen != nullptr, "libfabric: fi_dupinfo failed");
        return chosen;
    }
    MOERL_FAIL("libfabric provider '", provider, "'", domain.empty() ? "" : " in domain '" + domain + "'",
               " offers no FI_EP_RDM endpoint with RMA writes and remote CQ data",
               hmem ? detail::concat(" for a region in ", region_memory_name(memory),
                                     " memory (FI_HMEM: efa, verbs and shm have it where libfabric was "
                                     "built with CUDA; `fi_info -p ",
                                     provider, " -c FI_HMEM`)")
                    : std::string(),
               rejected.empty()
                   ? std::string(" (fi_getinfo found nothing; try `fi_info -p ") + provider + "`)"
                   : " (rejected:" + rejected + ")");
}

}  // namespace fabric

bool fabric_provider_available(const std::string& provider, std::string* why, RegionMemory memory) {
    try {
        fabric::select_info(provider, "", memory);
        return true;
    } catch (const Error& e) {
        if (why != nullptr) *why = e.message();
        return false;
    }
}

}  // namespace moerl::ep
