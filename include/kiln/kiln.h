/* kiln.h — the whole public API, one header per layer. */
#ifndef KILN_H
#define KILN_H
#include "kiln/tensor.h"
#include "kiln/ops.h"
#include "kiln/op.h"
#include "kiln/flex.h"
#include "kiln/nn.h"
#include "kiln/optim.h"
#include "kiln/io.h"
#include "kiln/tokenizer.h"
#include "kiln/data.h"
#include "kiln/metrics.h"
#include "kiln/dist.h"
#include "kiln/serve.h"
#include "kiln/graph.h"
#include "kiln/ext.h"
#endif
