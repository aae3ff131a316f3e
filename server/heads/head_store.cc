#include "server/heads/head_store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/heads/head_loader.h"

namespace logitserve {
namespace {

absl::Status CheckHead(const std::shared_ptr<const PreparedHead>& head) {
  if (head == nullptr) return absl::InvalidArgumentError("cannot store a null head");
  return ValidateHeadName(head->weights().name);
}

}  // namespace

absl::Status HeadStore::Add(std::shared_ptr<const PreparedHead> head) {
  LOGITSERVE_RETURN_IF_ERROR(CheckHead(head));
  const std::string& name = head->weights().name;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = heads_.try_emplace(name, std::move(head));
  if (!inserted) {
    return absl::AlreadyExistsError(absl::StrCat("head \"", name, "\" already exists (version ",
                                                 it->second->weights().version, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const PreparedHead>> HeadStore::Replace(
    std::shared_ptr<const PreparedHead> head) {
  LOGITSERVE_RETURN_IF_ERROR(CheckHead(head));
  const std::string& name = head->weights().name;
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) {
    heads_.emplace(name, std::move(head));
    return std::shared_ptr<const PreparedHead>();
  }
  const uint64_t old_version = it->second->weights().version;
  const uint64_t new_version = head->weights().version;
  if (new_version <= old_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("head \"", name, "\": cannot replace version ", old_version, " with version ",
                     new_version, " (versions must increase)"));
  }
  return std::exchange(it->second, std::move(head));
}

std::shared_ptr<const PreparedHead> HeadStore::Find(absl::string_view name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = heads_.find(name);
  return it == heads_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const PreparedHead>> HeadStore::List() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<const PreparedHead>> out;
  out.reserve(heads_.size());
  for (const auto& [name, head] : heads_) out.push_back(head);
  return out;
}

size_t HeadStore::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return heads_.size();
}

}  // namespace logitserve
