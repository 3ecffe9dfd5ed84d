"""Model-based tests of the radix tree and the prefix cache (machines live in radixkv.testing)."""

from radixkv.testing import PrefixCacheMachine, RadixTreeMachine

TestRadixTree = RadixTreeMachine.TestCase
TestPrefixCache = PrefixCacheMachine.TestCase
