// Anchor source of libcolossal.so; the library's content is every layer's static archive,
// linked whole (see CMakeLists.txt).
namespace colossal {
int libcolossal_anchor = 0;
}
