// Registrations for the daemons' unit tests: one worker holding rows [r0, r1) of tensor "w"
// [8, 4] f32 in a buffer of its own, in group "policy" (or a whole tensor of any shape).
#pragma once

#include <string>

#include "plan/test_layouts.h"
#include "proto/layout_codec.h"
#include "proto/refit.pb.h"

namespace refit::testing {

inline v1::RegisterWorkerRequest Registration(const std::string& name, v1::Role role, int64_t r0,
                                              int64_t r1, int32_t node,
                                              const std::string& group = "policy") {
  Layout l;
  AddSplitTensor(l, "w", Dims{8, 4}, DType::kF32, 0, {r0, r1}, {{0, 0}}, name);
  l.workers[0].name = name;
  l.workers[0].node = node;
  const v1::Layout proto = LayoutToProto(l);
  v1::RegisterWorkerRequest r;
  r.set_group(group);
  r.set_role(role);
  *r.mutable_tensors() = proto.tensors();
  *r.mutable_worker() = proto.workers(0);
  return r;
}

// One worker holding all of tensor `tensor` ([rows, ...] of `dtype`) in a buffer of its own.
inline v1::RegisterWorkerRequest WholeTensor(const std::string& name, v1::Role role,
                                             const std::string& tensor, Dims shape, DType dtype,
                                             int32_t node, const std::string& group = "policy") {
  Layout l;
  AddSplitTensor(l, tensor, shape, dtype, 0, {0, shape[0]}, {{node, 0}}, name);
  l.workers[0].name = name;
  const v1::Layout proto = LayoutToProto(l);
  v1::RegisterWorkerRequest r;
  r.set_group(group);
  r.set_role(role);
  *r.mutable_tensors() = proto.tensors();
  *r.mutable_worker() = proto.workers(0);
  return r;
}

inline v1::JoinRequest JoinOf(int32_t node, int64_t incarnation) {
  v1::JoinRequest j;
  j.set_node(node);
  j.set_incarnation(incarnation);
  j.set_control_address("10.0.0." + std::to_string(node) + ":7070");
  j.set_data_address("10.0.0." + std::to_string(node) + ":7071");
  return j;
}

inline v1::SyncWorkersRequest SyncOf(int32_t node, int64_t incarnation,
                                     std::initializer_list<v1::RegisterWorkerRequest> workers) {
  v1::SyncWorkersRequest s;
  s.set_node(node);
  s.set_incarnation(incarnation);
  for (const auto& w : workers) *s.add_workers() = w;
  return s;
}

}  // namespace refit::testing
