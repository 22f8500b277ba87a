// The session lifecycle (server/session_state.hpp): every move the drawing
// has, and none it has not.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

#include "session_state.hpp"

namespace cellblock {
namespace {

using S = SessionState;
constexpr S kAll[] = {S::starting, S::idle,     S::busy,    S::hibernating, S::hibernated,
                      S::resuming, S::adopting, S::closing, S::closed};

// The drawing in session_state.hpp, written out pair by pair.
const std::set<std::pair<S, S>> kMoves = {
    {S::starting, S::idle},      {S::starting, S::hibernated}, {S::idle, S::busy},
    {S::busy, S::idle},          {S::idle, S::hibernating},    {S::hibernating, S::hibernated},
    {S::hibernating, S::idle},   {S::hibernated, S::resuming}, {S::resuming, S::idle},
    {S::adopting, S::idle},      {S::starting, S::adopting},   {S::starting, S::closing},
    {S::idle, S::closing},       {S::busy, S::closing},        {S::hibernating, S::closing},
    {S::hibernated, S::closing}, {S::resuming, S::closing},    {S::adopting, S::closing},
    {S::closing, S::closed},
};

TEST(SessionState, EveryPairIsAllowedExactlyWhenTheDrawingHasIt) {
    for (S from : kAll) {
        for (S to : kAll) {
            EXPECT_EQ(transition_allowed(from, to), kMoves.count({from, to}) == 1)
                << state_name(from) << " -> " << state_name(to);
        }
    }
}

TEST(SessionState, NamesAreDistinctAndKnown) {
    std::set<std::string> names;
    for (S s : kAll) {
        const std::string name(state_name(s));
        EXPECT_NE(name, "unknown");
        names.insert(name);
    }
    EXPECT_EQ(names.size(), std::size(kAll));
}

TEST(SessionLifecycle, ARefusedMoveChangesNothing) {
    SessionLifecycle life;
    EXPECT_EQ(life.state(), S::starting);
    EXPECT_FALSE(life.go(S::busy));  // no execution before the kernel answers
    EXPECT_EQ(life.state(), S::starting);
    EXPECT_FALSE(life.attached());
    EXPECT_TRUE(life.go(S::closing));
    EXPECT_TRUE(life.go(S::closed));
    EXPECT_FALSE(life.go(S::idle));  // closed is final
    EXPECT_FALSE(life.go(S::closing));
    EXPECT_EQ(life.state(), S::closed);
}

TEST(SessionLifecycle, AttachedOnceTheKernelAnsweredEvenWhenClosedLater) {
    SessionLifecycle life;
    EXPECT_FALSE(life.kernel_live());
    ASSERT_TRUE(life.go(S::idle));
    EXPECT_TRUE(life.attached());
    EXPECT_TRUE(life.kernel_live());
    ASSERT_TRUE(life.go(S::busy));
    EXPECT_TRUE(life.kernel_live());
    ASSERT_TRUE(life.go(S::closing));
    EXPECT_TRUE(life.ending());
    EXPECT_FALSE(life.kernel_live());
    EXPECT_TRUE(life.attached());
}

TEST(SessionLifecycle, AHibernatedSessionHasNoKernelUntilResumed) {
    SessionLifecycle life(S::idle);
    ASSERT_TRUE(life.go(S::hibernating));
    EXPECT_TRUE(life.kernel_live());  // its state is still being saved
    ASSERT_TRUE(life.go(S::hibernated));
    EXPECT_FALSE(life.kernel_live());
    EXPECT_FALSE(life.go(S::idle));  // only through resuming
    ASSERT_TRUE(life.go(S::resuming));
    EXPECT_TRUE(life.kernel_live());  // the new kernel is asked to restore; clients wait
    ASSERT_TRUE(life.go(S::idle));
    EXPECT_TRUE(life.kernel_live());
}

}  // namespace
}  // namespace cellblock
