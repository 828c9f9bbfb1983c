/* Checkpoint and restore through the C ABI: tensors of a fake bridge (one
 * four times its ring) written to a file and restored bit-exact into a host
 * bridge; the recorded generation; a corrupt byte, a truncated file and a
 * missing one each refused with a message naming the file, nothing left
 * allocated; a failed write leaves no temporary file and the old file whole. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

enum { kRing = 1 << 16, kBig = 4 * kRing };

static devbridge_bridge* open_with_ring(const char* backend) {
  devbridge_open_options options = {0};
  options.size = sizeof options;
  options.backend = backend;
  options.ring_bytes = kRing;
  options.generation = 7;
  devbridge_bridge* bridge = NULL;
  CHECK_OK(devbridge_open(&options, &bridge));
  return bridge;
}

static devbridge_handle import(devbridge_bridge* bridge, devbridge_dtype dtype, const int64_t* dims, uint32_t rank,
                               const void* data, uint64_t len) {
  const devbridge_portable_view view = view_of(dtype, dims, rank, data, len);
  devbridge_handle handle;
  CHECK_OK(devbridge_import_tensor(bridge, &view, NULL, &handle));
  return handle;
}

static int same_bytes(devbridge_bridge* bridge, const devbridge_restored_tensor* t, const void* expected,
                      uint64_t len) {
  devbridge_portable* out = NULL;
  CHECK_OK(devbridge_export_tensor(bridge, t->handle, t->dtype, t->dims, t->rank, 0, &out));
  devbridge_portable_view view = {0};
  view.size = sizeof view;
  CHECK_OK(devbridge_portable_describe(out, &view));
  const int same = view.len == len && memcmp(view.data, expected, len) == 0;
  devbridge_portable_free(out);
  return same;
}

static const devbridge_restored_tensor* find(const devbridge_restored* restored, const char* name) {
  for (uint64_t i = 0; i < restored->count; ++i)
    if (strcmp(restored->tensors[i].name, name) == 0) return &restored->tensors[i];
  return NULL;
}

static int temporaries_in(const char* directory) {
  DIR* dir = opendir(directory);
  CHECK(dir != NULL);
  int found = 0;
  for (struct dirent* e = readdir(dir); e != NULL; e = readdir(dir))
    if (strstr(e->d_name, ".tmp") != NULL) ++found;
  closedir(dir);
  return found;
}

static void rewrite(const char* path, long at, int truncate_there) {
  FILE* file = fopen(path, "r+b");
  CHECK(file != NULL);
  if (truncate_there) {
    CHECK(ftruncate(fileno(file), at) == 0);
  } else {
    CHECK(fseek(file, at, SEEK_SET) == 0);
    const int byte = fgetc(file);
    CHECK(fseek(file, at, SEEK_SET) == 0);
    fputc(byte ^ 0x40, file);
  }
  fclose(file);
}

static long file_size(const char* path) {
  FILE* file = fopen(path, "rb");
  CHECK(file != NULL);
  fseek(file, 0, SEEK_END);
  const long size = ftell(file);
  fclose(file);
  return size;
}

int main(int argc, char** argv) {
  char directory[] = "/tmp/devbridge-c-checkpoint-XXXXXX";
  CHECK(mkdtemp(directory) != NULL);
  char path[256];
  snprintf(path, sizeof path, "%s/model.safetensors", directory);

  static uint32_t big[kBig / 4];
  for (uint32_t i = 0; i < kBig / 4; ++i) big[i] = i * 2654435761u;
  const int8_t small[6] = {-3, -2, -1, 0, 1, 2};
  const uint16_t half = 0x3f80; /* bfloat16 1.0, a rank-0 tensor */

  devbridge_bridge* fake = open_with_ring("fake");
  devbridge_bridge* host = open_with_ring("host");
  CHECK_OK(devbridge_fake_set_auto_complete(fake, 1));
  const int64_t big_dims[2] = {256, kBig / 4 / 256};
  const int64_t small_dims[2] = {2, 3};
  devbridge_checkpoint_entry entries[3] = {
      {"layer.weight", import(fake, DEVBRIDGE_DTYPE_FLOAT32, big_dims, 2, big, kBig), DEVBRIDGE_DTYPE_FLOAT32, 2,
       big_dims},
      {"b\xc3\xa9ta", import(fake, DEVBRIDGE_DTYPE_INT8, small_dims, 2, small, 6), DEVBRIDGE_DTYPE_INT8, 2, small_dims},
      {"scale", import(fake, DEVBRIDGE_DTYPE_BFLOAT16, NULL, 0, &half, 2), DEVBRIDGE_DTYPE_BFLOAT16, 0, NULL},
  };
  CHECK_OK(devbridge_checkpoint(fake, path, entries, 3, 0));
  CHECK(temporaries_in(directory) == 0);
  /* A name twice is refused before anything is written. */
  entries[1].name = "scale";
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_checkpoint(fake, path, entries, 3, 0));
  /* Also when the two sort apart (by width, then name): the header kept one, the data both. */
  entries[1].name = "layer.weight";
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_checkpoint(fake, path, entries, 3, 0));
  CHECK(strstr(devbridge_last_error_message(), "entries[0]'s too") != NULL);
  entries[1].name = "b\xc3\xa9ta";
  /* An empty tensor is refused when written, not when the whole file is restored. */
  const int64_t empty_dims[2] = {0, 3};
  entries[1].dims = empty_dims;
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_checkpoint(fake, path, entries, 3, 0));
  CHECK(strstr(devbridge_last_error_message(), "zero dimension") != NULL);
  entries[1].dims = small_dims;
  CHECK(temporaries_in(directory) == 0);
  /* A link is written through: its target is replaced, the link stays a link. */
  char link[512], real[512];
  snprintf(link, sizeof link, "%s/link.safetensors", directory);
  snprintf(real, sizeof real, "%s/real.safetensors", directory);
  CHECK(symlink("real.safetensors", link) == 0);
  CHECK_OK(devbridge_checkpoint(fake, link, entries, 3, 0));
  struct stat link_stat;
  CHECK(lstat(link, &link_stat) == 0 && S_ISLNK(link_stat.st_mode) && file_size(real) == file_size(path));
  CHECK(unlink(link) == 0 && unlink(real) == 0);
  /* A copy failing mid-write leaves the old file as it was, and no temporary. */
  const long written = file_size(path);
  CHECK_OK(devbridge_fake_inject(fake, DEVBRIDGE_FAKE_CALL_COPY_DEVICE_TO_HOST, DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION,
                                 2));
  CHECK_STATUS(DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED, devbridge_checkpoint(fake, path, entries, 3, 0));
  CHECK(strstr(devbridge_last_error_message(), "layer.weight") != NULL);
  CHECK(temporaries_in(directory) == 0 && file_size(path) == written);

  devbridge_restored* restored = NULL;
  CHECK_OK(devbridge_restore(host, path, &restored));
  CHECK(restored->count == 3 && restored->generation == 7);
  const devbridge_restored_tensor* weight = find(restored, "layer.weight");
  const devbridge_restored_tensor* beta = find(restored, "b\xc3\xa9ta");
  const devbridge_restored_tensor* scale = find(restored, "scale");
  CHECK(weight && beta && scale);
  CHECK(weight->dtype == DEVBRIDGE_DTYPE_FLOAT32 && weight->rank == 2 && weight->dims[1] == big_dims[1]);
  CHECK(beta->dtype == DEVBRIDGE_DTYPE_INT8 && scale->dtype == DEVBRIDGE_DTYPE_BFLOAT16 && scale->rank == 0);
  CHECK(same_bytes(host, weight, big, kBig) && same_bytes(host, beta, small, 6) && same_bytes(host, scale, &half, 2));
  for (uint64_t i = 0; i < restored->count; ++i) CHECK_OK(devbridge_free_device(host, restored->tensors[i].handle));
  devbridge_restored_free(restored);
  devbridge_restored_free(NULL);

  /* A subset, reading only its bytes: by name, by prefix, both; a checked
   * subset of a file with a checksum is refused (nothing to check it by). */
  devbridge_restore_options options = {0};
  options.size = sizeof options;
  options.prefix = "sc";
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore_selected(host, path, &options, &restored));
  CHECK(strstr(devbridge_last_error_message(), "skip_checksum") != NULL);
  CHECK(live_allocations(host) == 0);
  options.prefix = "no.such."; /* a selection of none: none restored, nothing to check (Python gives {}) */
  CHECK_OK(devbridge_restore_selected(host, path, &options, &restored));
  CHECK(restored->count == 0 && restored->tensors == NULL);
  devbridge_restored_free(restored);
  options.prefix = "sc";
  options.skip_checksum = 1;
  CHECK_OK(devbridge_restore_selected(host, path, &options, &restored));
  CHECK(restored->count == 1 && strcmp(restored->tensors[0].name, "scale") == 0);
  CHECK(same_bytes(host, &restored->tensors[0], &half, 2));
  CHECK_OK(devbridge_free_device(host, restored->tensors[0].handle));
  devbridge_restored_free(restored);
  const char* const wanted[2] = {"layer.weight", "b\xc3\xa9ta"};
  options.prefix = NULL;
  options.names = wanted;
  options.name_count = 2;
  CHECK_OK(devbridge_restore_selected(host, path, &options, &restored));
  CHECK(restored->count == 2 && strcmp(restored->tensors[0].name, wanted[0]) == 0);  /* in the file's order */
  CHECK(same_bytes(host, find(restored, "layer.weight"), big, kBig) && same_bytes(host, find(restored, wanted[1]), small, 6));
  for (uint64_t i = 0; i < restored->count; ++i) CHECK_OK(devbridge_free_device(host, restored->tensors[i].handle));
  devbridge_restored_free(restored);
  const char* const second_null[2] = {"layer.weight", NULL};
  options.names = second_null;
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore_selected(host, path, &options, &restored));
  CHECK(strstr(devbridge_last_error_message(), "options->names[1]") != NULL);
  options.names = wanted;
  options.prefix = "scale"; /* both filters apply: none passes both */
  CHECK_OK(devbridge_restore_selected(host, path, &options, &restored));
  CHECK(restored->count == 0 && restored->tensors == NULL);
  devbridge_restored_free(restored);
  /* Every tensor chosen, checked: as devbridge_restore. */
  devbridge_restore_options everything = {0};
  everything.size = sizeof everything;
  CHECK_OK(devbridge_restore_selected(host, path, &everything, &restored));
  CHECK(restored->count == 3);
  for (uint64_t i = 0; i < restored->count; ++i) CHECK_OK(devbridge_free_device(host, restored->tensors[i].handle));
  devbridge_restored_free(restored);
  CHECK(live_allocations(host) == 0);

  /* A file (as the safetensors package writes it) holding an empty tensor and
   * one of a dtype devbridge lacks: the others restore; either is refused only
   * when chosen, naming the file and the tensor. */
  char mixed[256];
  snprintf(mixed, sizeof mixed, "%s/mixed.safetensors", directory);
  {
    const char header[] = "{\"empty\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]},"
                          "\"scales\":{\"dtype\":\"F8_E8M0\",\"shape\":[4],\"data_offsets\":[0,4]},"
                          "\"w\":{\"dtype\":\"I8\",\"shape\":[2,3],\"data_offsets\":[4,10]}}";
    const uint64_t length = sizeof header - 1;
    unsigned char prefix[8];
    for (int i = 0; i < 8; ++i) prefix[i] = (unsigned char)(length >> (8 * i));
    FILE* file = fopen(mixed, "wb");
    CHECK(file != NULL);
    CHECK(fwrite(prefix, 1, 8, file) == 8 && fwrite(header, 1, length, file) == length);
    CHECK(fwrite("\1\2\3\4", 1, 4, file) == 4 && fwrite(small, 1, 6, file) == 6);
    fclose(file);
  }
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore(host, mixed, &restored));
  CHECK(strstr(devbridge_last_error_message(), "mixed.safetensors") != NULL);
  CHECK(strstr(devbridge_last_error_message(), "tensor 'empty'") != NULL);
  CHECK(live_allocations(host) == 0);
  const char* const only_w[1] = {"w"};
  devbridge_restore_options pick = {0};
  pick.size = sizeof pick;
  pick.names = only_w;
  pick.name_count = 1;
  CHECK_OK(devbridge_restore_selected(host, mixed, &pick, &restored));
  CHECK(restored->count == 1 && same_bytes(host, &restored->tensors[0], small, 6));
  CHECK_OK(devbridge_free_device(host, restored->tensors[0].handle));
  devbridge_restored_free(restored);
  pick.names = NULL;
  pick.name_count = 0;
  pick.prefix = "sc";
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore_selected(host, mixed, &pick, &restored));
  CHECK(strstr(devbridge_last_error_message(), "tensor 'scales': dtype 'F8_E8M0'") != NULL);
  CHECK(live_allocations(host) == 0);
  CHECK(unlink(mixed) == 0);

  /* "" names a tensor (the safetensors package writes it; restore reads it);
   * "__metadata__" is the header's own key. */
  char unnamed[256];
  snprintf(unnamed, sizeof unnamed, "%s/unnamed.safetensors", directory);
  devbridge_checkpoint_entry nameless = entries[1];
  nameless.name = "";
  CHECK_OK(devbridge_checkpoint(fake, unnamed, &nameless, 1, 0));
  CHECK_OK(devbridge_restore(host, unnamed, &restored));
  CHECK(restored->count == 1 && find(restored, "") != NULL && same_bytes(host, find(restored, ""), small, 6));
  CHECK_OK(devbridge_free_device(host, restored->tensors[0].handle));
  devbridge_restored_free(restored);
  nameless.name = "__metadata__";
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_checkpoint(fake, unnamed, &nameless, 1, 0));
  CHECK(strstr(devbridge_last_error_message(), "__metadata__") != NULL);
  CHECK(unlink(unnamed) == 0);

  /* argv[1]: keep a copy for the Python cross-check to read. */
  if (argc > 1) CHECK_OK(devbridge_checkpoint(fake, argv[1], entries, 3, 0));

  /* The last data byte flipped: the checksum differs; nothing stays allocated. */
  rewrite(path, written - 1, 0);
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore(host, path, &restored));
  CHECK(strstr(devbridge_last_error_message(), "model.safetensors") != NULL);
  CHECK(strstr(devbridge_last_error_message(), "checksum") != NULL);
  CHECK(live_allocations(host) == 0);
  /* Cut short in the first tensor's data: the header no longer fits the file. */
  rewrite(path, written - kBig / 2, 1);
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_restore(host, path, &restored));
  CHECK(strstr(devbridge_last_error_message(), "model.safetensors") != NULL);
  CHECK(live_allocations(host) == 0);
  unlink(path);
  CHECK_STATUS(DEVBRIDGE_ERROR_UNAVAILABLE, devbridge_restore(host, path, &restored));
  CHECK(strstr(devbridge_last_error_message(), "model.safetensors") != NULL);

  for (int i = 0; i < 3; ++i) CHECK_OK(devbridge_free_device(fake, entries[i].handle));
  CHECK(live_allocations(fake) == 0 && live_allocations(host) == 0);
  devbridge_destroy(fake);
  devbridge_destroy(host);
  CHECK(rmdir(directory) == 0);
  printf("c_api checkpoint: ok\n");
  return 0;
}
