// The generic layer family in one include: Linear, Embedding, RMSNorm, rotary embedding, the
// attention pieces (mask, KV cache, core attention) and the feed-forward slot. The models built
// from them live in models/ (models/llama/model.h).
#pragma once

#include "colossal/nn/attention.h"
#include "colossal/nn/embedding.h"
#include "colossal/nn/feed_forward.h"
#include "colossal/nn/linear.h"
#include "colossal/nn/norm.h"
#include "colossal/nn/rotary.h"
