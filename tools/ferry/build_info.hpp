// What the CLI knows of its own build, for the result files it writes.
#pragma once

namespace ferry::cli {

// The commit the CLI was built from ("<short hash>", "<short hash>-dirty" when tracked files differed from it, or ""
// outside a git checkout), taken at build time (cmake/GitCommit.cmake).
char const* git_commit();

}  // namespace ferry::cli
