// The named phases ("slots") the kernels record, declared once: the device enum (trace_format.hpp), the host name
// table and the decoder are all generated from this list, so a slot cannot exist on one side only.
//
// X(kernel, name): `kernel` is a TraceKernel (include/ferry/trace.hpp) and the slot's id is `kernel_name`
// (TraceSlot::dispatch_layout). Append new slots at the end of a kernel's group or of the list; a trace file records
// the names it was written with and the decoder refuses a file whose table differs.
#pragma once

#define FERRY_TRACE_SLOTS(X)                                                                                      \
  /* normal/dispatch.cuh: steps 1-7 */                                                                                   \
  X(dispatch, layout)         /* 1. destinations, positions and expert entries of the CTA's tokens */             \
  X(dispatch, grid_arrival)   /* 2. CTA counts to scratch, wait until every CTA of the rank has published */      \
  X(dispatch, count_exchange) /* 3. CTA 0: sum the CTAs' counts, write this rank's row into every rank, signal */ \
  X(dispatch, wait_counts)    /* 4. wait for every source's row of the count matrix, compute the bases */         \
  X(dispatch, push)           /* 5. rows and metadata straight into every destination */                          \
  X(dispatch, signal)         /* 6. CTA arrival; the last CTA signals every destination */                        \
  X(dispatch, wait_data)      /* 6. last CTA: wait for every source's data signal */                              \
  X(dispatch, outputs)        /* 7. last CTA: num_recv, per-source offsets, expert counts */                      \
  /* normal/land_dispatch.cuh (normal mode, small batches): steps 1-4 */                                                 \
  X(dispatch, land_send) /* 1. metadata to every rank, rows to their destinations' landing slots, arrival */      \
  X(dispatch, land_wait) /* 2. wait for every source's send CTAs */                                               \
  X(dispatch, land_scan) /* 3. ordered scan of the landed records: rank-major rows, metadata, counts */           \
  X(dispatch, land_copy) /* 4. landed rows into recv_x */                                                         \
  /* normal/combine.cuh: steps 1-3 */                                                                                    \
  X(combine, push)      /* 1. one item (tile, source): reduce and store its rows, release the tile's flag */      \
  X(combine, wait_tile) /* 2. wait for every rank's flag of one of this rank's tiles */                           \
  X(combine, sum)       /* 2. sum the tile's landing rows into y */                                               \
  X(combine, finish)    /* 3. arrival; the last CTA advances the sequence */                                      \
  /* ll/dispatch.cuh: send half 1-3, receive half 4-6 */                                                          \
  X(ll_dispatch, send)          /* 2. warp per token: metadata to every rank, the row to its destinations */      \
  X(ll_dispatch, send_arrival)  /* 3. barrier, then +1 on every destination's arrival counter */                  \
  X(ll_dispatch, wait_arrivals) /* 4. wait for every source's send CTAs */                                        \
  X(ll_dispatch, scan)          /* 5. ordered scan of the landed records, the CTA's share of the slots */         \
  X(ll_dispatch, copy)          /* 6. the share's landed rows into expert_x */                                    \
  X(ll_dispatch, own)           /* 2b. FERRY_LL_OWN_ROWS=direct: this rank's own rows from x into their slots */  \
  /* ll/combine.cuh: send half 1-2, receive half 3-4 */                                                           \
  X(ll_combine, send)          /* 1. the rows (reduced when expert-major) into each source's landing zone */      \
  X(ll_combine, send_arrival)  /* 2. barrier, then +1 on every source's arrival counter */                        \
  X(ll_combine, wait_arrivals) /* 3. wait for every rank's send CTAs */                                           \
  X(ll_combine, sum)           /* 4. y = sum over the token's ranks of their landing rows */
