/* A host-memory stand-in for libnccl.so.2 (and libcudart.so.13's two calls) for the CPU test of
 * src/runtime/nccl_ccl.cc: the ranks are threads of one process, buffers are host memory, and each
 * collective computes NCCL's documented result (nccl.h: ncclRedOp_t, ncclDataType_t values).
 * Supports float32 and int32; send/recv/split report an error (not exercised). Built twice: as
 * libnccl.so.2 and, with -DCUDART, as libcudart.so.13. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { int nranks, rank; } Comm;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

#ifndef CUDART
static pthread_barrier_t bar;
static int nranks_g = 0;
static const void* sends[64];
int stub_init_ranks[64];  /* nranks seen by each rank's ncclCommInitRank, for the test */

int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 0, sizeof(*id)); strcpy(id->internal, "stub-id"); return 0; }
int ncclCommInitRank(Comm** comm, int nranks, ncclUniqueId id, int rank) {
  if (strcmp(id.internal, "stub-id") != 0 || rank < 0 || rank >= nranks || nranks > 64) return 4;
  pthread_mutex_lock(&mu);
  if (nranks_g == 0) { nranks_g = nranks; pthread_barrier_init(&bar, NULL, nranks); }
  pthread_mutex_unlock(&mu);
  Comm* c = malloc(sizeof(Comm));
  c->nranks = nranks; c->rank = rank; *comm = c;
  stub_init_ranks[rank] = nranks;
  return 0;
}
int ncclCommSplit(void* a, int b, int c, void** d, void* e) { return 5; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
int ncclSend(const void* a, size_t n, int dt, int peer, void* c, void* s) { return 5; }
int ncclRecv(void* a, size_t n, int dt, int peer, void* c, void* s) { return 5; }
const char* ncclGetErrorString(int e) { return "nccl stub: unsupported call"; }
int ncclGetVersion(int* v) { *v = 23206; return 0; }

static size_t esize(int dt) { return dt == 7 || dt == 2 ? 4 : 0; }

int ncclAllReduce(const void* s, void* r, size_t n, int dt, int op, Comm* c, void* stream) {
  if (!esize(dt)) return 5;
  sends[c->rank] = s;
  pthread_barrier_wait(&bar);
  void* tmp = malloc(n * 4);
  for (size_t i = 0; i < n; ++i) {
    double acc = dt == 7 ? ((const float*)sends[0])[i] : ((const int*)sends[0])[i];
    for (int k = 1; k < c->nranks; ++k) {
      double v = dt == 7 ? ((const float*)sends[k])[i] : ((const int*)sends[k])[i];
      switch (op) {
        case 0: case 4: acc += v; break;           /* ncclSum, ncclAvg */
        case 1: acc *= v; break;                   /* ncclProd */
        case 2: acc = v > acc ? v : acc; break;    /* ncclMax */
        case 3: acc = v < acc ? v : acc; break;    /* ncclMin */
        default: free(tmp); return 5;
      }
    }
    if (op == 4) acc /= c->nranks;
    if (dt == 7) ((float*)tmp)[i] = (float)acc; else ((int*)tmp)[i] = (int)acc;
  }
  pthread_barrier_wait(&bar);  /* everyone has read every send buffer (recv may alias send) */
  memcpy(r, tmp, n * 4);
  free(tmp);
  pthread_barrier_wait(&bar);
  return 0;
}

int ncclBroadcast(const void* s, void* r, size_t n, int dt, int root, Comm* c, void* stream) {
  if (!esize(dt)) return 5;
  sends[c->rank] = s;
  pthread_barrier_wait(&bar);
  if (c->rank != root) memcpy(r, sends[root], n * esize(dt));
  else if (r != s) memcpy(r, s, n * esize(dt));
  pthread_barrier_wait(&bar);
  return 0;
}

int ncclAllGather(const void* s, void* r, size_t n, int dt, Comm* c, void* stream) {
  if (!esize(dt)) return 5;
  sends[c->rank] = s;
  pthread_barrier_wait(&bar);
  for (int k = 0; k < c->nranks; ++k) memcpy((char*)r + k * n * esize(dt), sends[k], n * esize(dt));
  pthread_barrier_wait(&bar);
  return 0;
}

#else
int stub_devices[64];     /* cudaSetDevice calls, in order */
int stub_num_devices = 0;

int cudaSetDevice(int d) {
  pthread_mutex_lock(&mu);
  stub_devices[stub_num_devices++] = d;
  pthread_mutex_unlock(&mu);
  return 0;
}
int cudaStreamSynchronize(void* s) { return 0; }
#endif
