/*!
 * \file tvm/support/serializer.h
 * \brief mlc-lora's stand-in for the TVM header the apache-tvm wheel does not ship: the Stream in
 * io.h serializes plain values directly, so nothing more is needed here.
 */
#ifndef TVM_SUPPORT_SERIALIZER_H_
#define TVM_SUPPORT_SERIALIZER_H_

#include <tvm/support/io.h>

#endif  // TVM_SUPPORT_SERIALIZER_H_
