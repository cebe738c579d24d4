// Copyright tensorwire authors.
//
// What the UCX we compile against offers beyond UCX 1.13, the oldest one
// tensorwire builds with (Debian bookworm's libucx-dev). Decided at build time
// from the headers' API version: each newer feature is used only where its
// macro is 1, with a fallback otherwise, and ucx_limits() (tensorwire info)
// names what the fallbacks cost. This is the one place these checks live.
#pragma once

#include <ucp/api/ucp_version.h>

#define TW_UCX_AT_LEAST(major, minor) (UCP_API_VERSION >= UCP_VERSION(major, minor))

// ucp_ep_query reports the transports an endpoint uses
// (UCP_EP_ATTR_FIELD_TRANSPORTS, UCX 1.14). Without it a channel cannot tell
// whether the peer must progress for an RMA to land, so it assumes so and
// takes the message form (Lane::needs_target_progress).
#define TW_UCX_HAS_EP_TRANSPORTS TW_UCX_AT_LEAST(1, 14)

// ucp_am_send_nbx copies the header of a send it cannot finish at once
// (UCP_AM_SEND_FLAG_COPY_HEADER, UCX 1.14). Without it the header must live
// until the send completes: post_message keeps a copy until then.
#define TW_UCX_HAS_AM_COPY_HEADER TW_UCX_AT_LEAST(1, 14)

// ucp_config_modify applies a transport's setting given by its full name
// (TCP_SNDBUF). UCX 1.13 keeps such a setting unused and warns "invalid
// configuration" (openucx/ucx#8649); 1.22 applies it; assumed from 1.14 on.
// Without it the transport tuning is left to the environment (UCX_CMA_BW).
#define TW_UCX_HAS_TL_CONFIG_MODIFY TW_UCX_AT_LEAST(1, 14)
