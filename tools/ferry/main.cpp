// PLACEHOLDER (lead replaces this file)
int main() {
  return 0;
}
